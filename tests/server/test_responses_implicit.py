"""POST /v1/responses without ``previous_response_id`` over implicit chains (agentrt.responses,
agentrt.implicit_chains), through the official ``openai`` client, as stateless coding-agent clients call it
(``store: false``, a ``prompt_cache_key``, the whole conversation re-sent as ``input`` items each time: user
messages, the earlier output's ``message`` / ``function_call`` items, ``function_call_output`` items): one
conversation resumes one chain (only the new items prefilled), sessions and tenants never resume each other's
chains, greedy outputs equal those of the same conversation chained by ``previous_response_id``, bad items are a
400 naming the field, and with implicit chains off such a history is still taken (imported into a new chain).
The OpenAI Agents SDK without ``auto_previous_response_id`` (it re-sends the conversation) runs on one chain."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from agentrt.responses import responses_service
from tests.live_servers import app_server, openai_client
from tests.server_helpers import bearer
from tests.tenant_servers import alice, bob, db_url, http, keys, server, tokens  # noqa: F401 (fixtures)

MODEL = "qwen3-tiny"  # the embedded model's name
INSTRUCTIONS = "You are terse."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def forced_call(tokens):
    return tokens(CALL)


def _ask(client, input, stream=False, **kw):
    """The response (a stream's final one)."""
    kw = {"model": MODEL, "input": input, "instructions": INSTRUCTIONS, "tools": [WEATHER], "temperature": 0,
          "max_output_tokens": 6, **kw}
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def _echo(response) -> list[dict]:
    """The response's output items as a client carries them into its next request."""
    return [item.model_dump(exclude_unset=True) for item in response.output]


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _chain_of(server, response) -> str:
    return responses_service(server.app.state).records[response.id].chain_id


def _chain(http, key, chain_id) -> dict:
    r = http.get(f"/v1/chains/{chain_id}?include_tokens=true", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _conversation(client, forced, first: str, send_full: bool = True, **kw) -> list:
    """Four requests: a question answered with a forced function call, the call's output, two follow-ups. With
    ``send_full`` each request re-sends the whole conversation; else each continues the previous response by
    ``previous_response_id`` with only its new items. The third request is streamed."""
    history: list = [_user(first)]
    responses = [_ask(client, history, max_output_tokens=len(forced), extra_body={"forced_token_ids": forced}, **kw)]
    (call,) = [o for o in responses[0].output if o.type == "function_call"]
    steps = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'},
             _user("And tomorrow?"), _user("Thanks.")]
    for n, step in enumerate(steps):
        history += [*_echo(responses[-1]), step]
        stream = n == 1
        if send_full:
            responses.append(_ask(client, history, stream=stream, **kw))
        else:
            responses.append(_ask(client, [step], stream=stream, previous_response_id=responses[-1].id, **kw))
    return responses


def test_a_conversation_resent_in_full_resumes_one_chain(alice, server, http, keys, forced_call):
    sent = _conversation(alice, forced_call, "Weather in Paris?", store=False, prompt_cache_key="conv-1")
    (call,) = sent[0].output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris"}')
    ids = {_chain_of(server, r) for r in sent}
    assert len(ids) == 1
    chain = _chain(http, keys["alice"], ids.pop())
    assert chain["num_turns"] == 4 and chain["system_prompt"] == INSTRUCTIONS
    assert chain["metadata"]["agentrt_implicit"]["session"] is not None
    assert [t["messages"] for t in chain["turns"]] == [
        [{"role": "user", "content": "Weather in Paris?"}],
        [{"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": call.call_id, "name": "get_weather"}],
        [{"role": "user", "content": "And tomorrow?"}], [{"role": "user", "content": "Thanks."}]]
    for r, turn in zip(sent, chain["turns"]):
        used = turn["usage"]
        assert r.usage.input_tokens == used["prompt_tokens"] and r.usage.output_tokens == used["completion_tokens"]
        assert r.usage.input_tokens_details.cached_tokens == used["prompt_tokens"] - used["prefilled_tokens"]
    for r, turn in zip(sent[1:], chain["turns"][1:]):
        assert turn["resume_status"] == "resumed"
        assert turn["usage"]["prefilled_tokens"] == len(turn["appended_token_ids"]) + 1  # only the new part
        assert r.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):  # store: false
        alice.responses.retrieve(sent[-1].id)


def test_interleaved_sessions_never_resume_each_others_chain(alice, server, http, keys):
    same = "Identical words in two sessions."
    history = {"k1": [_user(same)], "k2": [_user(same)]}
    chains: dict[str, set] = {"k1": set(), "k2": set()}
    for step in range(3):
        for key, items in history.items():
            r = _ask(alice, items, store=False, prompt_cache_key=key)
            chains[key].add(_chain_of(server, r))
            items += [*_echo(r), _user(f"step {step}")]
    assert len(chains["k1"]) == len(chains["k2"]) == 1 and chains["k1"] != chains["k2"]
    for key, items in history.items():
        chain = _chain(http, keys["alice"], next(iter(chains[key])))
        assert chain["num_turns"] == 3 and [t["resume_status"] for t in chain["turns"][1:]] == ["resumed"] * 2
        assert [t["messages"][0]["content"] for t in chain["turns"]] == [same, "step 0", "step 1"]


def test_another_tenant_never_resumes_the_chain(alice, bob, server, http, keys):
    history: list = [_user("Tenant-scoped prefix.")]
    first = _ask(alice, history, store=False, prompt_cache_key="shared-key")
    history += [*_echo(first), _user("Go on.")]
    theirs = _ask(bob, history, store=False, prompt_cache_key="shared-key")
    alice_chain, bob_chain = _chain_of(server, first), _chain_of(server, theirs)
    assert bob_chain != alice_chain
    assert http.get(f"/v1/chains/{alice_chain}", headers=bearer(keys["bob"])).status_code == 404
    chain = _chain(http, keys["bob"], bob_chain)  # alice's history imported into a chain of bob's
    assert chain["num_turns"] == 2 and chain["turns"][0]["usage"]["completion_tokens"] == 1
    again = _ask(alice, history, store=False, prompt_cache_key="shared-key")
    assert _chain_of(server, again) == alice_chain  # alice's chain was left for alice
    assert _chain(http, keys["alice"], alice_chain)["turns"][1]["resume_status"] == "resumed"
    assert again.output_text == theirs.output_text


def test_outputs_equal_the_conversation_chained_by_previous_response_id(alice, server, http, keys, forced_call):
    full = _conversation(alice, forced_call, "Weather in Paris, again?", store=False, prompt_cache_key="eq")
    chained = _conversation(alice, forced_call, "Weather in Paris, again?", send_full=False)
    for a, b in zip(full, chained):
        assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in a.output] == \
            [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in b.output]
        assert a.output_text == b.output_text
        assert a.usage.input_tokens == b.usage.input_tokens and a.usage.output_tokens == b.usage.output_tokens
    # the chained conversation's first (stored) response was a turn of an implicit chain, which
    # previous_response_id continued
    chain_id = _chain_of(server, chained[0])
    assert {_chain_of(server, r) for r in chained} == {chain_id} and _chain_of(server, full[0]) != chain_id
    chain = _chain(http, keys["alice"], chain_id)
    assert chain["num_turns"] == 4 and chain["metadata"]["agentrt_implicit"]["session"] is None
    assert alice.responses.retrieve(chained[0].id).output[0].type == "function_call"


def test_bad_items_are_a_400_naming_the_field_and_store_nothing(alice, server, http, keys):
    def count() -> tuple[int, int]:
        listed = http.get("/v1/chains?limit=100", headers=bearer(keys["alice"])).json()["data"]
        return len(listed), len(responses_service(server.app.state).records)

    before = count()
    output = {"type": "function_call_output", "call_id": "call_nowhere", "output": "18"}
    call = {"type": "function_call", "call_id": "call_late", "name": "get_weather", "arguments": "{}"}
    late = {"type": "function_call_output", "call_id": "call_late", "output": "18"}
    cases = [([_user("Hi"), output], "input[1].call_id"),
             ([_user("Hi"), late, call, _user("Hm")], "input[1].call_id"),  # the call must come first
             ([_user("Hi"), {"type": "web_search_call", "id": "ws_1"}], "input[1].type"),
             ([_user("Hi"), {"type": "message", "role": "assistant", "content": "Hello"}], "input"),
             ([{"type": "message", "role": "assistant", "content": "Hello"}, _user("Hi")], "input[0]"),
             ([_user("Hi"), {"type": "message", "role": "system", "content": "Late."}, _user("Ho")], "input[1].role")]
    for items, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _ask(alice, items, store=False, prompt_cache_key="bad")
        assert err.value.param == param, (items, err.value.body)
    assert count() == before


def test_implicit_chains_off_takes_the_history_into_a_new_chain(tmp_path, forced_call):
    with app_server(f"sqlite+aiosqlite:///{tmp_path / 'off.db'}", implicit_chains=False) as s, \
            httpx.Client(base_url=s.url, timeout=120) as http:
        client = openai_client(s.url)
        sent = _conversation(client, forced_call, "Weather in Paris?", store=False, prompt_cache_key="off")
        chains = [responses_service(s.app.state).records[r.id].chain_id for r in sent]
        assert len(set(chains)) == 4  # a new chain per request
        for n, (r, chain_id) in enumerate(zip(sent, chains)):
            chain = http.get(f"/v1/chains/{chain_id}").json()
            assert chain["metadata"] == {"agentrt_responses": True}
            assert chain["num_turns"] == n + 1  # the earlier replies imported, then the response's turn
            computed = sum(t["usage"]["prefilled_tokens"] for t in chain["turns"])
            assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - computed
        assert http.get(f"/v1/chains/{chains[1]}").json()["turns"][1]["messages"][0]["tool_call_id"] == \
            sent[0].output[0].call_id


def test_the_agents_sdk_resending_the_conversation_runs_on_one_chain(server, keys):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI otherwise

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "temp_c": 18})

    sent: list[dict] = []
    received: list[str] = []

    async def run():
        async def record(request: httpx.Request) -> None:
            if request.method == "POST":
                sent.append(json.loads(request.content))

        async def answer(response: httpx.Response) -> None:
            await response.aread()
            received.append(response.json()["id"])

        http = httpx.AsyncClient(event_hooks={"request": [record], "response": [answer]}, timeout=120)
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=keys["alice"], http_client=http, max_retries=0)
        settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=64, store=False,
                                 prompt_cache_key="agents-sdk")
        agent = Agent(name="assistant", instructions="Use the tools.", tools=[get_weather],
                      model=OpenAIResponsesModel(MODEL, client), model_settings=settings)
        try:
            return await Runner.run(agent, "Weather in Paris?", max_turns=4)
        finally:
            await http.aclose()

    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and len(sent) >= 2
    assert not any(body.get("previous_response_id") for body in sent)
    assert any(item.get("type") == "function_call" for item in sent[1]["input"])  # the whole conversation
    records = responses_service(server.app.state).records
    assert len({records[i].chain_id for i in received}) == 1
