"""Memory held by the server between loads: every per-chain and per-request object is freed when its chain is
deleted (exact counts, after each of two rounds), the native-memory helpers, and the bound on oneDNN's
per-shape kernel caches (docs/benchmarks.md, "Server memory under repeated load")."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
from litestar.testing import TestClient

from agentrt import native_memory
from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import TOOL_CALL, WEATHER_TOOL, make_engine, post_turn

SAMPLING = {"temperature": 0.0, "max_tokens": 6}


def _instances(*types: type) -> dict[str, int]:
    gc.collect()
    counts = {t.__module__ + "." + t.__qualname__: 0 for t in types}
    for obj in gc.get_objects():
        for t in types:
            if type(obj) is t:
                counts[t.__module__ + "." + t.__qualname__] += 1
    return counts


def _held(engine, app) -> dict[str, int]:
    """Everything the server keeps per chain or per request, by container."""
    state = app.state
    return {"engine chains": len(engine.chains.index), "engine requests": len(engine._requests),
            "detokenizers": len(engine._detokenizers), "deferred prunes": len(engine.chains.pruner.deferred),
            "cache tables": len(engine.cache._tables), "scheduler running": len(engine.scheduler.running),
            "scheduler waiting": len(engine.scheduler.waiting),
            "pages used": engine.pool.num_pages - engine.pool.num_free,
            "worker streams": len(state.worker._streams), "worker in flight": len(state.worker.inflight),
            "service chain states": len(state.chains.states), "service busy": len(state.chains.busy),
            "service chains": state.chains.num_chains}


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def _round(client, n: int, model: str) -> None:
    """``n`` chains through every chain route that keeps state (turns, a streamed turn, prune, fork, rewind),
    and an OpenAI completion (a turn of an implicit chain); then every chain deleted."""
    ids = []
    for i in range(n):
        r = client.post("/v1/chains", json={"system_prompt": f"agent {i}", "tools": [WEATHER_TOOL]})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        ids.append(cid)
        first = post_turn(client, cid, {"sampling": SAMPLING, "assistant_prefix": TOOL_CALL,
                                        "messages": [{"role": "user", "content": "Weather in Paris?"}]})
        call = first["message"]["tool_calls"][0]
        with client.stream("POST", f"/v1/chains/{cid}/turns", json={
                "sampling": SAMPLING, "stream": True,
                "messages": [{"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18}'}]}) as r:
            assert r.status_code == 200
            assert "event: done" in "".join(r.iter_text())
        r = client.post(f"/v1/chains/{cid}/prune", json={"kinds": ["tool_result"]})
        assert r.status_code == 200, r.text
        post_turn(client, cid, {"sampling": SAMPLING, "messages": [{"role": "user", "content": f"And {i}?"}]})
        r = client.post(f"/v1/chains/{cid}/fork", json={})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
        post_turn(client, ids[-1], {"sampling": SAMPLING, "messages": [{"role": "user", "content": "Forked?"}]})
        r = client.post(f"/v1/chains/{ids[-1]}/rewind", json={"num_turns": 1})
        assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    ids.append(r.json()["chain"]["id"])  # the completion ran as a turn of an implicit chain
    for cid in ids:
        assert client.delete(f"/v1/chains/{cid}").status_code == 204


def test_deleted_chains_leave_nothing_behind(tmp_path):
    from agentrt.chain_state import ChainState as ServiceChainState
    from agentrt.engine_worker import RequestStream
    from engine.chain_index import ChainState
    from engine.detokenizer import IncrementalDetokenizer
    from engine.paged_cache import PageTable
    from engine.request import Request

    engine = make_engine(random_model_dir())
    app = create_app(ServerConfig(model=engine.config.model, db_url=f"sqlite+aiosqlite:///{tmp_path / 's.db'}"),
                     engine=engine)
    kinds = (Request, ChainState, IncrementalDetokenizer, PageTable, RequestStream, ServiceChainState)
    with TestClient(base_url="http://127.0.0.1", app=app, timeout=120) as client:
        model = app.state.model_name
        for n in (3, 5):  # the same after a second, larger round: nothing accumulates
            _round(client, n, model)
            assert _nonzero(_held(engine, app)) == {}
            assert _nonzero(_instances(*kinds)) == {}


# --- native memory helpers ------------------------------------------------------------------------------
needs_glibc = pytest.mark.skipif(not native_memory.available(), reason="glibc malloc only")


@needs_glibc
def test_malloc_views():
    stats = native_memory.malloc_stats()
    assert set(stats) >= {"in_use", "free", "heap", "mmap"} and stats["in_use"] > 0
    # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so a chunk of its own whatever ran before
    block = bytearray(64 * 2**20)
    after = native_memory.malloc_stats()
    grown = after["mmap"] + after["in_use"] - stats["mmap"] - stats["in_use"]
    assert grown >= len(block) - 8 * 2**20  # other threads allocate and free meanwhile
    del block
    arenas = native_memory.malloc_arenas()
    assert arenas[0]["arena"] == 0 and arenas[0]["system"] > 0
    assert isinstance(native_memory.malloc_trim(), bool)


def test_bound_native_caches_keeps_what_the_environment_sets(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert native_memory.bound_native_caches(32) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32",
                                                      "LRU_CACHE_CAPACITY": "7"}


def test_idle_trimmer_trims_once_per_idle_period(monkeypatch):
    now = [100.0]
    calls = []
    monkeypatch.setattr(native_memory.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(native_memory, "malloc_trim", lambda: calls.append(now[0]) or True)
    trimmer = native_memory.IdleTrimmer(idle_s=5.0, enabled=True)
    assert not trimmer.maybe_trim()  # nothing ran yet: nothing to give back
    trimmer.note_step()
    now[0] += 4.9
    assert not trimmer.maybe_trim() and calls == []
    now[0] += 0.2
    assert trimmer.maybe_trim() and calls == [now[0]]
    now[0] += 60
    assert not trimmer.maybe_trim() and len(calls) == 1  # still the same idle period
    trimmer.note_step()
    now[0] += 5.0
    assert trimmer.maybe_trim() and len(calls) == 2 and trimmer.trims == 2
    assert not native_memory.IdleTrimmer(idle_s=0.0, enabled=False).maybe_trim()


GROWTH = textwrap.dedent("""
    import sys
    if sys.argv[1] != "unbounded":
        from agentrt.native_memory import bound_native_caches
        bound_native_caches(int(sys.argv[1]))
    import torch
    import torch.nn.functional as F
    from agentrt.native_memory import malloc_stats
    torch.set_num_threads(1)
    w = torch.randn(192, 64, dtype=torch.bfloat16)
    F.linear(torch.randn(1, 64, dtype=torch.bfloat16), w)
    before = malloc_stats()["in_use"]
    for rows in range(2, 302):  # a new row count each call: a new kernel in each cache
        F.linear(torch.randn(rows, 64, dtype=torch.bfloat16), w)
    print(malloc_stats()["in_use"] - before)
""")


def _growth(capacity: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in native_memory.CACHE_CAPACITY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", GROWTH, capacity], capture_output=True, text=True, env=env,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return int(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_bound_caps_onednn_kernel_caches():
    """300 new row counts: oneDNN's default caches keep a kernel for each (~0.5 MB a row count), the bounded
    ones at most 16 per cache."""
    unbounded = _growth("unbounded")
    if unbounded < 60 * 2**20:
        pytest.skip(f"this torch build does not cache a bf16 matmul kernel per shape (+{unbounded >> 20} MB)")
    assert _growth("16") < 24 * 2**20 < unbounded
