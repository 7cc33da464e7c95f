"""The server with overlapped decode windows (``overlap_decode``, ``decode_steps`` 4 and 1): an agent session's turns
(a tool call, its result, a question; streamed and not) resume the chain and generate what a bare engine
generates one step at a time on the same history, and the streamed deltas add up to the turn."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, WEATHER_TOOL, generate_direct, make_engine, sse_events, weather_tool_round

SAMPLING = {"temperature": 0.0, "max_tokens": 14}


@pytest.fixture(scope="module")
def model_dir():
    return random_model_dir()


@pytest.fixture(scope="module", params=[4, 1], ids=["windows-of-4", "single-steps"])
def client(request, model_dir, tmp_path_factory):
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'windows.db'}"
    options = {**ENGINE_OPTIONS, "decode_steps": request.param, "overlap_decode": True}
    with TestClient(base_url="http://127.0.0.1", app=create_app(ServerConfig(model=model_dir, db_url=db_url, engine_options=options)),
                    timeout=120) as c:
        c.decode_steps = request.param
        yield c


def test_turns_through_overlapped_windows_equal_single_steps(client, model_dir):
    cid = client.post("/v1/chains", json={"system_prompt": "You are a weather agent.", "tools": [WEATHER_TOOL]}).json()["id"]

    weather_tool_round(client, cid, SAMPLING)
    body = {"messages": [{"role": "user", "content": "Umbrella?"}], "sampling": SAMPLING, "stream": True}
    with client.stream("POST", f"/v1/chains/{cid}/turns", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    deltas = [data for name, data in events if name == "delta"]
    (name, final), = [e for e in events if e[0] != "delta"]
    assert name == "done"
    chain = client.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    assert [t for d in deltas for t in d["token_ids"]] == chain["turns"][-1]["generated_token_ids"]
    assert "".join(d["text"] for d in deltas) == final["message"]["content"]
    assert max(len(d["token_ids"]) for d in deltas) == client.decode_steps  # a window's tokens come together
    engine = make_engine(model_dir)  # single steps, no windows
    for t in chain["turns"]:
        prompt = chain["token_ids"][:t["usage"]["prompt_tokens"]]
        assert generate_direct(engine, prompt, SAMPLING["max_tokens"]) == t["generated_token_ids"]
    assert [t["usage"]["cached_tokens"] > 0 for t in chain["turns"]][1:] == [True, True]  # the chain resumed
