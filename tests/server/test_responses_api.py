"""OpenAI's Responses API (agentrt.responses) through the official ``openai`` package against a live server on the
random test model: conversations by ``previous_response_id`` as chain turns (only the new items prefilled), a
forced function call and its output, a branch from an older response, streaming, ``store: false`` and errors.
References: the chain API read back over HTTP, and a fresh conversation given the same history."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentrt.responses import responses_service
from tests.live_servers import client, model, server  # noqa: F401 (fixtures)

N = 4  # max_output_tokens
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _ask(client, model, input, **kw):
    return client.responses.create(model=model, input=input, **{"temperature": 0, "max_output_tokens": N, **kw})


def _chain_of(server, response_id):
    return responses_service(server.app.state).records[response_id].chain_id


def _chain(http, chain_id) -> dict:
    r = http.get(f"/v1/chains/{chain_id}?include_tokens=true")
    assert r.status_code == 200, r.text
    return r.json()


def test_three_turns_prefill_only_the_new_items(client, model, server, http):
    first = _ask(client, model, "Hello there", instructions="Be brief.")
    assert first.status in ("completed", "incomplete") and first.object == "response"
    assert first.output and first.output[0].type == "message"
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = _ask(client, model, "And then?", previous_response_id=first.id)
    echoed = [item.model_dump(exclude_unset=True) for item in second.output]  # as clients carry the output
    third = _ask(client, model, [*echoed, {"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": "Go on"}]}],
                 previous_response_id=second.id)
    chain_id = _chain_of(server, first.id)
    assert _chain_of(server, second.id) == _chain_of(server, third.id) == chain_id
    chain = _chain(http, chain_id)
    assert chain["num_turns"] == 3 and chain["system_prompt"] == "Be brief."
    assert [t["messages"][0]["content"] for t in chain["turns"]] == ["Hello there", "And then?", "Go on"]
    for later, turn in zip((second, third), chain["turns"][1:]):
        u, counted = later.usage, turn["usage"]
        assert u.input_tokens_details.cached_tokens > 0
        assert u.total_tokens == u.input_tokens + u.output_tokens
        # the chain's counters: its KV resumed, only the new items (and the token the KV lacks) prefilled
        assert counted["resumed_tokens"] > 0 and counted["prefilled_tokens"] <= len(turn["appended_token_ids"]) + 1
        assert u.input_tokens == counted["prompt_tokens"]
        assert u.input_tokens_details.cached_tokens == counted["prompt_tokens"] - counted["prefilled_tokens"]
        assert u.output_tokens == counted["completion_tokens"]
    # the second turn computed only its new tokens: the first turn's log was resumed
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert third.usage.input_tokens == len(chain["token_ids"]) - third.usage.output_tokens
    # retrieve, input_items
    got = client.responses.retrieve(third.id)
    assert got.id == third.id and got.output[0].content[0].text == third.output[0].content[0].text
    items = client.responses.input_items.list(third.id)
    assert [i.type for i in items.data][0] == "message" and items.data[0].content[0].text == "Go on"


def test_forced_function_call_and_its_output(client, model, server, http):
    call = _ask(client, model, "Weather in Oslo?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64)
    calls = [o for o in call.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", call
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    chain = _chain(http, _chain_of(server, call.id))
    assert chain["turns"][0]["message"]["tool_calls"][0]["id"] == calls[0].call_id
    # the output, with the call echoed back (as clients do)
    echoed = {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
              "arguments": calls[0].arguments}
    answer = _ask(client, model, [echoed, {"type": "function_call_output", "call_id": calls[0].call_id,
                                           "output": "sunny"}], previous_response_id=call.id, tools=[WEATHER])
    chain = _chain(http, _chain_of(server, answer.id))
    assert chain["num_turns"] == 2
    tool = chain["turns"][1]["messages"][0]
    assert tool["role"] == "tool" and tool["tool_call_id"] == calls[0].call_id and tool["content"] == "sunny"
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_branch_from_an_older_response_equals_a_fresh_conversation(client, model, server, http):
    first = _ask(client, model, "Tell me a story", instructions="Be brief.")
    _ask(client, model, "Longer", previous_response_id=first.id)
    branch = _ask(client, model, "Shorter", previous_response_id=first.id)
    assert _chain_of(server, branch.id) != _chain_of(server, first.id)
    chain = _chain(http, _chain_of(server, branch.id))
    assert [t["messages"][0]["content"] for t in chain["turns"]] == ["Tell me a story", "Shorter"]
    assert branch.usage.input_tokens_details.cached_tokens > 0
    # the same history, sent to a fresh chain turn by turn
    fresh1 = _ask(client, model, "Tell me a story", instructions="Be brief.")
    fresh2 = _ask(client, model, "Shorter", previous_response_id=fresh1.id)
    assert branch.output_text == fresh2.output_text
    assert fresh1.output_text == first.output_text


def test_streamed_events_assemble_to_the_response(client, model):
    kw = dict(model=model, input="Stream this", instructions="Be brief.", temperature=0, max_output_tokens=6)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    if text:
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"]
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text


def test_streamed_function_call(client, model):
    kw = dict(model=model, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=64)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == next(o for o in plain.output if o.type == "function_call").arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_store_false_and_delete(client, model):
    hidden = _ask(client, model, "Secret", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(hidden.id)
    follow = _ask(client, model, "More", previous_response_id=hidden.id)  # the chain still serves it
    assert follow.usage.input_tokens_details.cached_tokens > 0
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(follow.id)


@pytest.mark.parametrize("kw, field", [
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ({"input": [{"type": "message", "role": "user", "content": "x"},
                {"type": "message", "role": "system", "content": "y"}]}, "input[1].role"),
])
def test_errors_name_the_field(client, model, http, kw, field):
    kw = {"input": "Hi", **kw}
    before = http.get("/v1/chains?limit=1").json()["total"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, max_output_tokens=N, **kw)
    assert field in str(err.value)
    assert (err.value.param or "").startswith(field) and err.value.type == "invalid_request_error"
    assert http.get("/v1/chains?limit=1").json()["total"] == before  # no chain left behind


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = _ask(client, model, "JSON please", max_output_tokens=32,
             text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"ok"}
    assert r.text.format.type == "json_schema"


def test_changed_tools_or_instructions_are_refused_on_a_continuation(client, model):
    first = _ask(client, model, "Hi", instructions="Be brief.", tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="instructions"):
        _ask(client, model, "Again", instructions="Be long.", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError, match="tools"):
        _ask(client, model, "Again", tools=[{**WEATHER, "name": "other"}], previous_response_id=first.id)
    ok = _ask(client, model, "Again", instructions="Be brief.", tools=[WEATHER], previous_response_id=first.id)
    assert ok.previous_response_id == first.id and ok.instructions == "Be brief."
