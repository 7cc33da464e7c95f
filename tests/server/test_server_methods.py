"""Per-chain sparse methods on one server (the real app, Litestar's TestClient, the random tiny model).

A chain created with its own method runs every turn with it; the reference is a bare engine *configured*
with that method replaying the chain's turns (the same token log, Chain Cache on), which must emit the same
tokens. Bad methods are 400s naming the field and create nothing.
"""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS

SAMPLING = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
SNAPKV = {"method": "snapkv", "method_config": {"budget": 48, "window": 8}}
STREAMING = {"method": "streaming_llm", "method_config": {"sink_tokens": 4, "window": 40}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'methods.db'}"
    app = create_app(ServerConfig(model=random_model_dir(), db_url=db, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as c:
        yield c


def _create(client, **body) -> dict:
    r = client.post("/v1/chains", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _turn(client, cid, text) -> dict:
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": text}],
                                                     "sampling": SAMPLING})
    assert r.status_code == 200, r.text
    return r.json()


def _replay_on_engine(method: str, config: dict, chain: dict) -> list[list[int]]:
    """Each turn's generated tokens from a bare engine configured with ``method``, fed the chain's log."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(random_model_dir(), method=method, method_config=config, **ENGINE_OPTIONS))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    history, generated = [], []
    for turn in chain["turns"]:
        history += turn["appended_token_ids"]
        rid = engine.add_request(list(history), params, chain_id="ref")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    generated.append(list(out.token_ids))
        history += generated[-1]
    return generated


@pytest.mark.parametrize("body", [{}, SNAPKV, STREAMING], ids=["server-method", "snapkv", "streaming_llm"])
def test_each_chain_runs_its_own_method(client, body):
    chain = _create(client, system_prompt="You are terse. " * 20, **body)
    expected_method = body.get("method", "dense")
    assert chain["method"] == expected_method
    results = [_turn(client, chain["id"], f"question {i}: " + "tell me more " * 15) for i in range(3)]
    assert [r["resume_status"] for r in results] == ["created", "resumed", "resumed"]
    state = client.get(f"/v1/chains/{chain['id']}", params={"include_tokens": True}).json()
    assert state["method"] == expected_method and state["method_config"] == body.get("method_config", {})
    reference = _replay_on_engine(expected_method, body.get("method_config", {}), state)
    assert [t["generated_token_ids"] for t in state["turns"]] == reference
    if body is SNAPKV:  # the chain's KV is SnapKV's: at most the budget (+ the last turn's new tokens) per layer
        kv = state["kv"]
        assert kv["physical_tokens"] < kv["logical_tokens"]


def test_forked_chain_keeps_its_method(client):
    chain = _create(client, **SNAPKV)
    _turn(client, chain["id"], "hello " * 30)
    r = client.post(f"/v1/chains/{chain['id']}/fork", json={})
    assert r.status_code in (200, 201), r.text
    fork = r.json()
    assert fork["method"] == "snapkv" and fork["method_config"] == SNAPKV["method_config"]
    assert _turn(client, fork["id"], "and then?")["resume_status"] in ("resumed", "recomputed")


@pytest.mark.parametrize("body,key", [
    ({"method": "no-such-method"}, "method"),
    ({"method": "snapkv", "method_config": {"budget": 8, "window": 16}}, "method_config"),
    ({"method": "snapkv", "method_config": {"budgett": 8}}, "method_config"),
    ({"method_config": {"budget": 8}}, "method_config"),  # the server's method (dense) has no knobs
    ({"method": "omnikv", "method_config": {"observation_layers": [99]}}, "method_config"),
])
def test_bad_methods_are_400_naming_the_field_and_create_nothing(client, body, key):
    before = client.get("/v1/chains").json()
    r = client.post("/v1/chains", json=body)
    assert r.status_code == 400, r.text
    assert key in [d.get("key") for d in r.json().get("extra") or []], r.json()
    assert client.get("/v1/chains").json() == before


def test_a_chain_whose_method_cannot_run_after_a_restart_is_a_400_and_keeps_its_turns(tmp_path):
    """Created with Quest on a plain server; restarted on fp8 KV storage, which Quest's page selection cannot
    read: the next turn is a 400 naming ``method`` and the chain is as it was."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'restart.db'}"
    quest = {"method": "quest", "method_config": {"token_budget": 32, "dense_layers": 1}}
    app = create_app(ServerConfig(model=random_model_dir(), db_url=db, engine_options=ENGINE_OPTIONS))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as c:
        cid = _create(c, **quest)["id"]
        _turn(c, cid, "hello " * 10)
        before = c.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    options = {**ENGINE_OPTIONS, "kv_storage": "fp8"}
    app = create_app(ServerConfig(model=random_model_dir(), db_url=db, engine_options=options))
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as c:
        r = c.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "again"}],
                                                   "sampling": SAMPLING})
        assert r.status_code == 400, r.text
        assert "method" in [d.get("key") for d in r.json().get("extra") or []]
        after = c.get(f"/v1/chains/{cid}", params={"include_tokens": True}).json()
    assert after["turns"] == before["turns"] and after["token_ids"] == before["token_ids"]
