"""The OpenAI Agents SDK (``openai-agents``, import name ``agents``) runs an agent with two function tools against a
live server on the embedded model, through the Responses API (``OpenAIResponsesModel``, each turn continuing the
previous response with ``auto_previous_response_id``: the server keeps the conversation as a chain) and through
chat completions (``OpenAIChatCompletionsModel``, the whole conversation re-sent each turn), run to the end and
streamed.

The embedded model is tiny and trained on a small corpus: nothing here checks what it says. The first turn forces
a tool call (``ModelSettings(tool_choice="required")``; the SDK resets it to auto after the call, as it does by
default), which the server constrains to the declared tools (agentrt.structured_spec). Checked: the
run completes; every call the model made names a declared tool and its arguments parse against that tool's JSON
schema, and the tool ran with them; the tool's result went back to the server (the next request holds the
``function_call_output`` item / the ``tool`` message with the call's id and the tool's output)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from tests.live_servers import app_server

set_tracing_disabled(True)  # the SDK would send traces to OpenAI otherwise


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded model (no ``model``: the one `agentrt serve` serves by default) under uvicorn."""
    with app_server(f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('agents') / 'server.db'}") as server:
        yield server


def _agent(model, invoked: list[tuple[str, dict]]) -> tuple[Agent, dict[str, dict]]:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        invoked.append(("get_weather", {"city": city}))
        return json.dumps({"city": city, "temp_c": 18})

    @function_tool
    def add(a: int, b: int) -> int:
        """The sum of two integers."""
        invoked.append(("add", {"a": a, "b": b}))
        return a + b

    tools = [get_weather, add]
    agent = Agent(name="assistant", instructions="You are a helpful assistant. Use the tools.", tools=tools,
                  model=model, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=256))
    return agent, {t.name: t.params_json_schema for t in tools}


async def _run(url: str, api: str, streamed: bool, sent: list[dict], invoked: list[tuple[str, dict]]):
    """The agent's run (its result, the tools' JSON schemas), each POST body the SDK sent recorded in ``sent``."""

    async def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0)
    try:
        name = (await client.models.list()).data[0].id
        model = OpenAIResponsesModel(name, client) if api == "responses" else OpenAIChatCompletionsModel(name, client)
        agent, schemas = _agent(model, invoked)
        question = "What is the weather in Paris, and what is 2 + 3?"
        chained = api == "responses"  # the server holds the conversation: each turn sends only the new items
        if streamed:
            result = Runner.run_streamed(agent, question, max_turns=6, auto_previous_response_id=chained)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question, max_turns=6, auto_previous_response_id=chained)
    finally:
        await http.aclose()
    return result, schemas


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_with_two_tools_runs_to_the_end(embedded, api, streamed):
    sent: list[dict] = []
    invoked: list[tuple[str, dict]] = []
    result, schemas = asyncio.run(_run(embedded.url, api, streamed, sent, invoked))

    assert isinstance(result.final_output, str)  # the run completed: a last turn without tool calls
    assert sent[0]["tool_choice"] == "required"
    declared = {t["name"] if api == "responses" else t["function"]["name"] for t in sent[0]["tools"]}
    assert declared == {"get_weather", "add"}

    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = {item.raw_item["call_id"] if isinstance(item.raw_item, dict) else item.raw_item.call_id: item
               for item in result.new_items if isinstance(item, ToolCallOutputItem)}
    assert calls, "the forced first turn made no tool call"
    assert len(invoked) == len(calls)
    for call, (tool, arguments) in zip(calls, invoked):
        assert call.name in schemas and call.name == tool
        parsed = json.loads(call.arguments)
        jsonschema_rs.validate(schemas[call.name], parsed)  # the declared tool's arguments
        assert parsed == arguments  # and the tool ran with them
        # the tool's result went back: a later request carries it under the call's id
        output = outputs[call.call_id].raw_item
        output_text = output["output"] if isinstance(output, dict) else output.output
        if api == "responses":
            fed = [i for body in sent for i in body["input"] if isinstance(body["input"], list)
                   and isinstance(i, dict) and i.get("type") == "function_call_output" and i["call_id"] == call.call_id]
            assert [i["output"] for i in fed] == [output_text]
        else:
            fed = [m for body in sent for m in body["messages"]
                   if m.get("role") == "tool" and m.get("tool_call_id") == call.call_id]
            assert fed and all(m["content"] == output_text for m in fed)
    if api == "responses":  # each turn after the first continues the previous response (the chain)
        assert all(body.get("previous_response_id") for body in sent[1:]) and len(sent) >= 2
