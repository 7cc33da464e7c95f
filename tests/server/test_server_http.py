"""The server under a real uvicorn on a loopback port: OpenAI client, live streaming, 409, disconnects, batching."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.local_server import LocalServer
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, WEATHER_TOOL, sse_events

USER = [{"role": "user", "content": "Tell me a long story"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("db") / "http.db"
    app = create_app(ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{db}",
                                  engine_options=ENGINE_OPTIONS))
    with LocalServer(app) as s:
        yield s


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _new_chain(http) -> str:
    r = http.post("/v1/chains", json={"tools": [WEATHER_TOOL]})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _wait_idle(http, cid, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chain = http.get(f"/v1/chains/{cid}").json()
        if chain["status"] == "idle":
            return chain
        time.sleep(0.05)
    raise AssertionError("chain stayed busy")


def _metric(http, name) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_openai_client_streaming_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    done = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                          tools=[WEATHER_TOOL])
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop", "tool_calls")
    assert done.usage.completion_tokens == 12 or choice.finish_reason != "length"
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                                 tools=[WEATHER_TOOL], stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")  # greedy: the same tokens either way
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second time the prompt is cached

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages, n=2)
    with pytest.raises(openai.NotFoundError):  # as OpenAI answers an unknown model
        client.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])


def test_live_stream_busy_chain_409_and_finish(http):
    cid = _new_chain(http)
    body = {"messages": USER, "sampling": {"max_tokens": 400, "ignore_eos": True}, "stream": True}
    with http.stream("POST", f"/v1/chains/{cid}/turns", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert http.get(f"/v1/chains/{cid}").json()["status"] == "busy"
        second = http.post(f"/v1/chains/{cid}/turns", json={"messages": USER})
        assert second.status_code == 409 and cid in second.json()["detail"]
        assert http.delete(f"/v1/chains/{cid}").status_code == 409
        events = sse_events([first, *lines])
    assert events[-1][0] == "done" and events[-1][1]["usage"]["completion_tokens"] == 400
    assert "".join(d["text"] for name, d in events if name == "delta") == events[-1][1]["message"]["content"]
    assert _wait_idle(http, cid)["num_turns"] == 1


def test_client_disconnect_aborts_the_turn_and_changes_nothing(http, server):
    cid = _new_chain(http)
    assert http.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": {"max_tokens": 4}}).status_code == 200
    before = http.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    long = {"messages": USER, "sampling": {"max_tokens": 3000, "ignore_eos": True}}
    with http.stream("POST", f"/v1/chains/{cid}/turns", json={**long, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))
    assert _wait_idle(http, cid)["num_turns"] == 1
    with httpx.Client(base_url=server.url, timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(f"/v1/chains/{cid}/turns", json=long)
    _wait_idle(http, cid)
    after = http.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    for key in ("turns", "regions", "token_ids", "num_tokens"):
        assert after[key] == before[key], key
    deadline = time.monotonic() + 10
    while _metric(http, "agentrt_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(http, "agentrt_requests_running") == 0
    assert _metric(http, 'agentrt_turns_total{outcome="aborted"}') >= 2
    r = http.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": {"max_tokens": 4}})
    assert r.status_code == 200 and r.json()["turn"] == 1


def test_many_chains_decode_in_one_batch(http, server):
    chains = [_new_chain(http) for _ in range(4)]
    steps_before = _metric(http, "agentrt_engine_step_requests_count")
    singles_before = _metric(http, 'agentrt_engine_step_requests_bucket{le="1.0"}')

    def turn(cid):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": {"max_tokens": 48}})
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(turn, chains))
    assert len({r["message"]["content"] for r in results}) == 1  # same history, greedy: same tokens, batched or not
    steps = _metric(http, "agentrt_engine_step_requests_count") - steps_before
    singles = _metric(http, 'agentrt_engine_step_requests_bucket{le="1.0"}') - singles_before
    assert steps < 4 * 48 and singles < steps  # most steps carried several chains
