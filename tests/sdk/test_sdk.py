"""The SDK against a live server on loopback (uvicorn in a thread, the random tiny model, SQLite in tmp),
plus deterministic retry / agent-loop checks over httpx.MockTransport."""

from __future__ import annotations

import asyncio
import types
import json
import time

import httpx
import msgspec
import pytest

from sdk import (Agent, AssistantMessage, AsyncClient, AuthError, Chain, ChainRead, Client, Conflict, Invalid, NotFound,
                 Overloaded, PruneResult, Sampling, ToolResultMessage, TurnDelta, TurnResult, UserMessage)
from tests.server_helpers import ENGINE_OPTIONS, TOOL_CALL, WEATHER_TOOL

FAST = {"max_tokens": 6}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer
    from engine.tiny_checkpoint import random_model_dir

    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sdk') / 'server.db'}"
    app = create_app(ServerConfig(model=random_model_dir(), db_url=db, engine_options=ENGINE_OPTIONS))
    with LocalServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, timeout=60) as c:
        yield c


def test_session_turns_state_and_stream(client):
    chain = client.chains.create(system_prompt="You are a weather agent.", tools=[WEATHER_TOOL],
                                 metadata={"test": "sdk"})
    assert chain.info.num_turns == 0 and chain.info.tools[0].function.name == "get_weather"
    first = chain.send("Weather in Paris?", assistant_prefix=TOOL_CALL, **FAST)
    assert isinstance(first, TurnResult) and first.resume_status == "created"
    call = first.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    second = chain.send(tool_results=[(call, {"temp_c": 18})], sampling=Sampling(max_tokens=6))
    assert second.turn == 1 and second.resume_status == "resumed" and second.usage.resumed_tokens > 0
    third = chain.send(UserMessage(content="Umbrella?"), sampling={"max_tokens": 4}, temperature=0.0)
    assert third.turn == 2 and third.usage.completion_tokens <= 4

    state = chain.state()
    assert isinstance(state, ChainRead) and state.num_turns == 3 and chain.info is state
    assert {"system", "user", "assistant", "tool_result"} <= {r.kind for r in state.regions}
    tool_region = next(r for r in state.regions if r.kind == "tool_result")
    assert (tool_region.tool_name, tool_region.tool_call_id, tool_region.round) == ("get_weather", call.id, 0)
    sent = state.turns[1].messages[0]
    assert isinstance(sent, ToolResultMessage) and json.loads(sent.content) == {"temp_c": 18}

    items = list(chain.stream("Tell me more.", max_tokens=8))
    *deltas, end = items
    assert deltas and all(isinstance(d, TurnDelta) for d in deltas) and isinstance(end, TurnResult)
    assert "".join(d.text for d in deltas) == end.message.content and end.turn == 3
    tokens = chain.state(include_tokens=True).turns[3].generated_token_ids
    assert [t for d in deltas for t in d.token_ids] == tokens

    assert client.chains.get(chain.id).info.num_turns == 4
    listed = client.chains.list(limit=100)
    assert chain.id in [c.id for c in listed.data] and listed.total >= 1
    assert client.health()


def test_prune_fork_rewind_delete(client):
    chain = client.chains.create(tools=[WEATHER_TOOL])
    call = chain.send("Weather?", assistant_prefix=TOOL_CALL, **FAST).message.tool_calls[0]
    chain.send(tool_results=[ToolResultMessage(content="sunny", tool_call_id=call.id)], **FAST)
    pruned = chain.prune(kinds=["tool_result"], tool_names=["get_weather"])
    assert isinstance(pruned, PruneResult) and pruned.event.source == "explicit" and pruned.tokens_freed > 0
    assert all(r.kind == "tool_result" and r.pruned for r in pruned.regions)
    n = chain.state().kv.computed_tokens
    assert chain.prune([(0, 2)]).event.intervals == [(0, 2)] and n >= 2

    fork = chain.fork(metadata={"branch": "b"})
    assert fork.id != chain.id and fork.info.parent_id == chain.id and fork.info.metadata == {"branch": "b"}
    assert fork.send("On the branch.", **FAST).turn == 2
    assert chain.state().num_turns == 2  # the parent is untouched

    boundary = chain.info.turns[1].usage.prompt_tokens  # not a turn boundary: the prompt excludes the output
    with pytest.raises(Invalid) as err:
        chain.rewind(num_tokens=boundary)
    assert err.value.status_code == 400
    rewound = chain.rewind(1)
    assert rewound.num_turns == 1 and chain.info is rewound and rewound.prune_events == []
    assert chain.send("again", **FAST).turn == 1

    fork.delete()
    with pytest.raises(NotFound):
        fork.state()
    with pytest.raises(NotFound):
        fork.delete()


def test_a_chain_with_its_own_method(client):
    chain = client.chains.create(method="snapkv", method_config={"budget": 48, "window": 8})
    assert chain.info.method == "snapkv"
    for i in range(2):
        turn = chain.send(f"question {i}: " + "tell me more " * 20, **FAST)
    assert turn.resume_status == "resumed"
    kv = chain.state().kv
    assert kv.physical_tokens < kv.logical_tokens  # SnapKV compacted the chain's KV
    chain.delete()


def test_typed_errors_rest_and_websocket(client):
    with pytest.raises(NotFound) as err:
        client.chains.get("chain_nope")
    assert err.value.status_code == 404 and "chain_nope" in err.value.detail
    chain = client.chains.create()
    with pytest.raises(Invalid) as err:
        chain.send("x", sampling=Sampling(max_tokens=0))
    assert err.value.field == "sampling.max_tokens" and err.value.status_code == 400
    with pytest.raises(Invalid) as err:
        chain.send([{"role": "tool", "content": "x"}])
    assert "messages[0].tool_call_id" in err.value.fields
    chain.send("hello there", **FAST)
    with pytest.raises(Invalid) as err:
        chain.prune([(5, 5)])
    assert err.value.field == "intervals[0]"
    with pytest.raises(Invalid) as err:
        client.chains.create(prune_policy={"lag": -1})
    assert err.value.field == "prune_policy.lag"
    with pytest.raises(Invalid) as err:
        client.chains.create(method="snapkv", method_config={"budget": 8, "window": 16})
    assert err.value.field == "method_config"

    with pytest.raises(Invalid) as err:  # over the WebSocket: the same typed errors
        list(chain.stream("x", max_tokens=0))
    assert err.value.field == "sampling.max_tokens"
    with pytest.raises(NotFound):
        list(Chain(client, msgspec.structs.replace(chain.info, id="chain_nope")).stream("x"))

    long = chain.stream("long", max_tokens=400, ignore_eos=True)
    assert isinstance(next(long), TurnDelta)  # the turn is in flight
    with pytest.raises(Conflict) as err:
        chain.send("second", **FAST)
    assert err.value.status_code == 409
    for call in (chain.fork, chain.delete, lambda: chain.prune(kinds=["user"]), lambda: chain.rewind(0)):
        with pytest.raises(Conflict):
            call()
    long.close()  # closing the socket aborts the turn
    for _ in range(200):
        if chain.state().status == "idle":
            break
        time.sleep(0.05)
    assert chain.send("after", **FAST).turn == 1


def _flaky(statuses, body=b'{"data": [], "offset": 0, "limit": 20, "total": 0, "has_more": false}', after="0"):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        status = statuses[min(len(calls) - 1, len(statuses) - 1)]
        if status == 503:
            return httpx.Response(503, headers={"Retry-After": after},
                                  json={"status_code": 503, "detail": "engine queue is full"})
        if status == 401:
            return httpx.Response(401, json={"status_code": 401, "detail": "an API key is required"})
        return httpx.Response(status, content=body)
    return httpx.MockTransport(handler), calls


def test_retry_on_503_sync(monkeypatch):
    slept = []
    monkeypatch.setattr("sdk.client.time.sleep", slept.append)
    transport, calls = _flaky([503, 503, 200], after="0.25")
    with Client("http://agentrt.test", transport=transport, max_retries=3) as c:
        assert c.chains.list().total == 0
    assert len(calls) == 3 and slept == [0.25, 0.25]  # the server's Retry-After, not the backoff

    transport, calls = _flaky([503])
    with Client("http://agentrt.test", transport=transport, max_retries=2) as c, pytest.raises(Overloaded) as err:
        c.chains.list()
    assert len(calls) == 3 and err.value.status_code == 503 and err.value.retry_after == 0.0

    slept.clear()
    transport, calls = _flaky([503, 503, 200], after="soon")  # unparsable: exponential backoff
    with Client("http://agentrt.test", transport=transport, backoff=0.1) as c:
        c.chains.list()
    assert slept == [0.1, 0.2]

    transport, calls = _flaky([401])
    with Client("http://agentrt.test", api_key="art_x_y", transport=transport) as c, pytest.raises(AuthError):
        c.chains.list()
    assert len(calls) == 1 and calls[0].headers["authorization"] == "Bearer art_x_y"


def test_retry_on_503_async(monkeypatch):
    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)
    # the client module's asyncio only: patching asyncio.sleep itself would also record the sleeps of any other
    # event loop in this process (a live server thread left by another test)
    import sdk.async_client
    monkeypatch.setattr(sdk.async_client, "asyncio", types.SimpleNamespace(
        **{name: getattr(asyncio, name) for name in dir(asyncio) if not name.startswith("__")} | {"sleep": fake_sleep}))

    async def main():
        transport, calls = _flaky([503, 200], after="1")
        async with AsyncClient("http://agentrt.test", transport=transport) as c:
            assert (await c.chains.list()).has_more is False
        assert len(calls) == 2 and slept == [1.0]
        transport, calls = _flaky([503])
        async with AsyncClient("http://agentrt.test", transport=transport, max_retries=1) as c:
            with pytest.raises(Overloaded):
                await c.chains.list()
        assert len(calls) == 2
    asyncio.run(main())


def _weather_agent(calls):
    agent = Agent()

    @agent.tool
    def get_weather(city: str) -> dict:
        """Current weather for a city"""
        calls.append(city)
        return {"city": city, "temp_c": 18}
    return agent


def test_agent_loop_live(client):
    calls = []
    agent = _weather_agent(calls)
    assert agent.tools()[0].function.parameters == {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}
    chain = client.chains.create(system_prompt="You are a weather agent.", tools=agent.tools())
    out = agent.run(chain, "Weather in Paris?", max_rounds=3, assistant_prefix=TOOL_CALL, max_tokens=6)
    assert calls == ["Paris"] and out.finished and len(out.turns) == 2
    user, asked, result, answer = out.messages
    assert isinstance(user, UserMessage) and isinstance(asked, AssistantMessage) and answer is out.final
    call = asked.tool_calls[0]
    assert isinstance(result, ToolResultMessage) and (result.tool_call_id, result.name) == (call.id, "get_weather")
    assert json.loads(result.content) == {"city": "Paris", "temp_c": 18}
    state = chain.state()
    assert state.turns[1].messages == [result]
    assert [(r.tool_name, r.tool_call_id) for r in state.regions if r.kind == "tool_result"] == [("get_weather", call.id)]


def test_agent_loop_stops_at_max_rounds_and_reports_tool_errors():
    """A mock server that always answers with two tool calls: one known, one unknown."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chains":
            return httpx.Response(201, content=msgspec.json.encode(_chain_read("chain_m")))
        bodies.append(json.loads(request.content))
        n = len(bodies)
        calls = [{"id": f"call_{n}a", "function": {"name": "get_weather", "arguments": json.dumps({"city": f"C{n}"})}},
                 {"id": f"call_{n}b", "function": {"name": "nope", "arguments": "{}"}}]
        return httpx.Response(200, json={"chain_id": "chain_m", "turn": n - 1, "finish_reason": "stop",
                                         "message": {"content": "...", "tool_calls": calls},
                                         "usage": dict.fromkeys(("prompt_tokens", "appended_tokens", "prefilled_tokens",
                                                                 "resumed_tokens", "cached_tokens",
                                                                 "completion_tokens"), 0),
                                         "resume_status": "resumed"})
    calls = []
    agent = _weather_agent(calls)
    with Client("http://agentrt.test", transport=httpx.MockTransport(handler)) as c:
        out = agent.run(c.chains.create(tools=agent.tools()), "go", max_rounds=2,
                        assistant_prefix=lambda i: f"p{i}")
    assert not out.finished and len(out.turns) == 3 and calls == ["C1", "C2"]
    assert [b.get("assistant_prefix") for b in bodies] == ["p0", "p1", "p2"]
    assert bodies[0]["messages"] == [{"role": "user", "content": "go"}]
    tool_msgs = bodies[1]["messages"]
    assert [(m["role"], m["tool_call_id"], m["name"]) for m in tool_msgs] == [
        ("tool", "call_1a", "get_weather"), ("tool", "call_1b", "nope")]
    assert json.loads(tool_msgs[0]["content"]) == {"city": "C1", "temp_c": 18}
    assert tool_msgs[1]["content"].startswith("error: unknown tool")


def _chain_read(cid):
    return {"id": cid, "created_at": 0.0, "model": "m", "method": "dense", "status": "idle", "num_turns": 0,
            "num_tokens": 0, "metadata": {}, "method_config": {}, "system_prompt": "", "tools": [], "turns": [],
            "regions": [], "kv": {"logical_tokens": 0, "resident": False}}


def test_async_client_live(server):
    calls = []

    async def main():
        async with AsyncClient(server.url, timeout=60) as c:
            agent = Agent()

            @agent.tool
            async def get_weather(city: str) -> str:
                calls.append(city)
                return "sunny"
            chain = await c.chains.create(tools=agent.tools())
            out = await agent.arun(chain, "Weather?", assistant_prefix=TOOL_CALL, max_tokens=6)
            assert out.finished and out.messages[2].content == "sunny"
            items = [item async for item in chain.stream("More?", max_tokens=6)]
            assert "".join(d.text for d in items[:-1]) == items[-1].message.content and items[-1].turn == 2
            state = await chain.state()
            assert state.num_turns == 3 and (await c.chains.get(chain.id)).id == chain.id
            fork = await chain.fork()
            assert (await fork.send("branch", **FAST)).turn == 3
            assert (await chain.prune(kinds=["tool_result"])).event.source == "explicit"
            assert (await chain.rewind(1)).num_turns == 1
            assert chain.id in [s.id for s in (await c.chains.list(limit=100)).data]
            await fork.delete()
            with pytest.raises(NotFound):
                await fork.state()
            with pytest.raises(Invalid) as err:
                await chain.send("x", sampling=Sampling(max_tokens=0))
            assert err.value.field == "sampling.max_tokens"
            with pytest.raises(Invalid):
                [item async for item in chain.stream("x", max_tokens=0)]
    asyncio.run(main())
    assert calls == ["Paris"]
