"""Scale-out on Ray Serve (agentrt.scaleout): two engine replicas behind two HTTP replicas on a local Ray instance,
driven over HTTP as clients would.

What is checked, against the server's own counters (``usage``, ``resume_status``) and the database:
- with chain affinity every turn after a chain's first prefills only its new tokens (it reached the replica that
  holds the chain); the same run routed at random recomputes (the check can fail);
- a killed engine replica: its in-flight turns fail with a retryable 503 and change nothing, every chain goes on
  (recomputed on the other replica), every committed turn is in the database;
- one chain, many concurrent turns through both HTTP replicas: exactly one runs, the others get 409.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray")  # the test extra installs it; a bare install without it skips
from ray import serve  # noqa: E402

from agentrt.config import ServerConfig  # noqa: E402
from agentrt.scaleout.deploy import APP_NAME, ScaleOut, build_application  # noqa: E402
from tests.server_helpers import TOOL_CALL, WEATHER_TOOL  # noqa: E402

pytestmark = pytest.mark.timeout(900)
SAMPLING = {"temperature": 0.0, "max_tokens": 6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(url: str, db_url: str, affinity: bool = True, replicas: int = 2, **engine_options) -> None:
    config = ServerConfig(db_url=db_url, engine_options={"device": "cpu", "num_pages": 512, **engine_options})
    serve.run(build_application(config, ScaleOut(replicas=replicas, http_replicas=2, affinity=affinity)),
              name=APP_NAME, route_prefix="/")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every engine replica heard from, and no other
        metrics = httpx.get(url + "/metrics", timeout=10).text
        if f"agentrt_replicas {replicas}.0" in metrics:
            return
        time.sleep(0.5)
    raise AssertionError("the engine replicas did not come up")


async def _turn(c: httpx.AsyncClient, cid: str, text: str, sampling: dict = SAMPLING) -> httpx.Response:
    return await c.post(f"/v1/chains/{cid}/turns", json={"sampling": sampling,
                                                        "messages": [{"role": "user", "content": text}]})


async def _session(c: httpx.AsyncClient, i: int, turns: int) -> list[dict]:
    r = await c.post("/v1/chains", json={})
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    results = []
    for t in range(turns):
        r = await _turn(c, cid, f"session {i}, step {t}: what next?")
        assert r.status_code == 200, r.text
        results.append(r.json())
    return results


def _run_sessions(url: str, sessions: int, turns: int) -> list[list[dict]]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return await asyncio.gather(*(_session(c, i, turns) for i in range(sessions)))
    return asyncio.run(main())


def _db_owners(db_path) -> dict[str, str]:
    import sqlite3

    with sqlite3.connect(db_path) as conn:
        return dict(conn.execute("SELECT chain_id, owner FROM chain_leases"))


def test_turns_reach_the_engine_replica_holding_their_chain(ray_serve, tmp_path):
    db = tmp_path / "affinity.db"
    _deploy(ray_serve, f"sqlite+aiosqlite:///{db}")
    runs = _run_sessions(ray_serve, sessions=8, turns=6)
    for run in runs:
        assert run[0]["resume_status"] == "created"
        for turn in run[1:]:  # the owner resumes the chain: only the appended tokens (and the last generated one)
            assert turn["resume_status"] == "resumed", turn
            assert turn["usage"]["prefilled_tokens"] <= turn["usage"]["appended_tokens"] + 1, turn["usage"]
    owners = _db_owners(db)
    assert len(owners) == 8 and len(set(owners.values())) == 2  # new chains spread over both replicas


def test_load_64_chains_x_20_turns_across_the_replicas_without_an_error(ray_serve, tmp_path):
    """64 sessions at once, 20 turns each, through both HTTP replicas: every turn answers 200 and none
    recomputes (each engine replica has room for its chains). Timings are benchmarks/scaleout.py's."""
    _deploy(ray_serve, f"sqlite+aiosqlite:///{tmp_path / 'load.db'}", num_pages=4096)

    async def session(c: httpx.AsyncClient, i: int) -> list[tuple[int, str | None]]:
        cid = (await c.post("/v1/chains", json={})).json()["id"]
        seen = []
        for t in range(20):
            r = await _turn(c, cid, f"{i}/{t}", {"temperature": 0.0, "max_tokens": 4})
            seen.append((r.status_code, r.json().get("resume_status") if r.status_code == 200 else r.text))
        return seen

    async def main():
        async with httpx.AsyncClient(base_url=ray_serve, timeout=600) as c:
            return await asyncio.gather(*(session(c, i) for i in range(64)))
    runs = asyncio.run(main())
    bad = [x for run in runs for x in run if x[0] != 200]
    assert not bad, bad[:5]
    assert all([s for _, s in run] == ["created"] + ["resumed"] * 19 for run in runs)


def test_without_affinity_turns_recompute(ray_serve, tmp_path):
    _deploy(ray_serve, f"sqlite+aiosqlite:///{tmp_path / 'random.db'}", affinity=False)
    runs = _run_sessions(ray_serve, sessions=8, turns=6)
    later = [t for run in runs for t in run[1:]]
    missed = [t for t in later if t["usage"]["prefilled_tokens"] > t["usage"]["appended_tokens"] + 1]
    assert missed, "random routing never sent a turn away from its chain's replica"
    assert any(t["resume_status"] == "recomputed" for t in later)


def test_stateless_clients_resume_their_implicit_chains_whichever_http_replica_answers(ray_serve, tmp_path):
    """The official ``openai`` client re-sending whole conversations: each conversation keeps one chain and every
    request after its first resumes it, though the HTTP replicas take turns answering (a chain made by one is
    found by the other)."""
    from openai import OpenAI

    _deploy(ray_serve, f"sqlite+aiosqlite:///{tmp_path / 'implicit.db'}")
    client = OpenAI(base_url=ray_serve + "/v1", api_key="unused", max_retries=0)
    chains = []
    for conv in range(4):
        history = [{"role": "user", "content": f"Conversation {conv}: count with me."}]
        ids = []
        for step in range(4):
            r = client.chat.completions.create(model="qwen3-tiny", messages=history, temperature=0.0,
                                               max_tokens=6)
            ids.append(r.model_extra["chain"]["id"])
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": f"Step {step}."}]
        assert len(set(ids)) == 1, ids
        chains.append(ids[0])
    with httpx.Client(base_url=ray_serve, timeout=60) as c:
        for cid in chains:
            turns = c.get(f"/v1/chains/{cid}").json()["turns"]
            assert len(turns) == 4 and all(t["resume_status"] == "resumed" for t in turns[1:]), turns


def test_websocket_and_sse_turns_stream_through_the_replicas(ray_serve, tmp_path):
    """The streaming transports pass Ray Serve's proxy: a chain turn over the chain's WebSocket (the SDK) and a
    streamed chat completion (SSE, the ``openai`` client) arrive as deltas that add up to the final text."""
    from openai import OpenAI

    from sdk import Client
    from sdk.schema import TurnDelta, TurnResult

    _deploy(ray_serve, f"sqlite+aiosqlite:///{tmp_path / 'stream.db'}")
    with Client(ray_serve, timeout=120) as client:
        chain = client.chains.create()
        for step in range(2):
            items = list(chain.stream(f"step {step}", temperature=0.0, max_tokens=8, ignore_eos=True))
            deltas = [i for i in items if isinstance(i, TurnDelta)]
            (result,) = [i for i in items if isinstance(i, TurnResult)]
            assert len(deltas) >= 2 and "".join(d.text for d in deltas) == result.message.content
            assert result.resume_status == ("created" if step == 0 else "resumed")
    stream = OpenAI(base_url=ray_serve + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model="qwen3-tiny", messages=[{"role": "user", "content": "stream please"}], temperature=0.0, max_tokens=8,
        stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) >= 2 and "".join(chunks)


def test_the_documented_cluster_config_is_a_valid_serve_config_that_builds():
    """docs/scale-out.md's config file: Ray Serve's own schema accepts it and its application builds (nothing
    starts: building binds the deployments)."""
    import re
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from agentrt.scaleout.deploy import app_builder

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    config = ServeDeploySchema.model_validate(yaml.safe_load(block))
    (app,) = config.applications
    assert app.import_path == "agentrt.scaleout.deploy:app_builder"
    built = app_builder(app.args)
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown server option"):
        app_builder({"server": {"modle": "x"}})


def test_concurrent_turns_on_one_chain_through_both_http_replicas(ray_serve, tmp_path):
    db = tmp_path / "lease.db"
    _deploy(ray_serve, f"sqlite+aiosqlite:///{db}")

    async def main():
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as c:
            cid = (await c.post("/v1/chains", json={})).json()["id"]
            assert (await _turn(c, cid, "first")).status_code == 200
            codes = []
            for _ in range(4):  # rounds of simultaneous turns: the proxy spreads them over both HTTP replicas
                rs = await asyncio.gather(*(_turn(c, cid, f"racer {k}") for k in range(6)))
                codes.append(sorted(r.status_code for r in rs))
            chain = (await c.get(f"/v1/chains/{cid}")).json()
            return codes, chain
    codes, chain = asyncio.run(main())
    # A racer that starts after a round's winner finished also wins (gather does not make them simultaneous), so
    # a round may have more than one 200; every 200 must be a turn of the chain's one history, every other a 409.
    for round_codes in codes:
        assert round_codes.count(200) >= 1 and set(round_codes) <= {200, 409}, codes
    assert sum(rc.count(409) for rc in codes) > 0, codes
    assert chain["num_turns"] == 1 + sum(rc.count(200) for rc in codes)


def test_two_http_replicas_never_run_one_chain_at_once(ray_serve, tmp_path):
    """Forced: two HTTP replicas (two apps in this process, each with its own lease holder, both on the deployed
    engine replicas). While another holder has the chain's lease (an operation of replica A in flight), B's turn
    gets 409 and runs nothing; once it is released B's turn runs, on the chain's owner, on top of A's last turn
    (read from the database, not from B's memory)."""
    from litestar.testing import AsyncTestClient

    from agentrt.app import create_app
    from agentrt.db import open_database
    from agentrt.scaleout.leases import ChainLeases
    from agentrt.scaleout.remote_engine import RemoteEngine

    url = f"sqlite+aiosqlite:///{tmp_path / 'two.db'}"
    _deploy(ray_serve, url)
    config = ServerConfig(db_url=url)
    handle = serve.get_deployment_handle("engine", APP_NAME)

    def app(holder: str):
        async def remote(database):
            leases = ChainLeases(database, holder)
            worker = RemoteEngine(handle, database, leases)
            await worker.start()
            return worker, leases
        return create_app(config, remote=remote)

    async def main():
        db = await open_database(url)
        async with AsyncTestClient(app("http-a"), base_url="http://localhost", timeout=300) as a, \
                AsyncTestClient(app("http-b"), base_url="http://localhost", timeout=300) as b:
            cid = (await a.post("/v1/chains", json={})).json()["id"]
            first = await _turn(a, cid, "from a")
            held = await ChainLeases(db, "http-a").acquire(cid)  # A's next operation on the chain, in flight
            refused = await _turn(b, cid, "me too")
            await ChainLeases(db, "http-a").release(held)
            second = await _turn(b, cid, "now me")
            chain = (await b.get(f"/v1/chains/{cid}")).json()
            # a tool round on A with a pruning policy: A keeps the lease through the policy's prune, then B's
            # turn, sent right after A's answer, runs
            pid = (await a.post("/v1/chains", json={"tools": [WEATHER_TOOL],
                                                     "prune_policy": {"lag": 0}})).json()["id"]
            call = (await a.post(f"/v1/chains/{pid}/turns", json={
                "sampling": SAMPLING, "assistant_prefix": TOOL_CALL,
                "messages": [{"role": "user", "content": "Weather in Paris?"}]})).json()["message"]["tool_calls"][0]
            tool = await a.post(f"/v1/chains/{pid}/turns", json={"sampling": SAMPLING, "messages": [
                {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18}'}]})
            after = await _turn(b, pid, "and tomorrow?")
            policy = (await b.get(f"/v1/chains/{pid}")).json()
        await db.dispose()
        return first, refused, second, chain, tool, after, policy
    first, refused, second, chain, tool, after, policy = asyncio.run(main())
    assert tool.status_code == 200 and len(tool.json()["pruned"]) == 1, tool.text
    assert after.status_code == 200, after.text
    assert len(policy["prune_events"]) == 1 and policy["num_turns"] == 3
    assert refused.status_code == 409, refused.text
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert second.json()["turn"] == 1 and second.json()["resume_status"] == "resumed"
    assert chain["num_turns"] == 2 and [t["messages"][0]["content"] for t in chain["turns"]] == ["from a", "now me"]


def test_a_killed_engine_replica_loses_no_committed_turn(ray_serve, tmp_path):
    db = tmp_path / "failover.db"
    _deploy(ray_serve, f"sqlite+aiosqlite:///{db}")
    long = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as c:
            cids = [(await c.post("/v1/chains", json={})).json()["id"] for _ in range(6)]
            committed = dict.fromkeys(cids, 0)
            for cid in cids:
                assert (await _turn(c, cid, "warm up")).status_code == 200
                committed[cid] += 1
            owners = _db_owners(db)
            victim = owners[cids[0]]
            pid = _replica_pid(db, victim)
            in_flight = [asyncio.ensure_future(_turn(c, cid, "a long answer", long)) for cid in cids]
            await asyncio.sleep(0.2)
            since = time.time()
            while True:  # a heartbeat after the turns were sent shows them running on the victim
                beat, stats = _replica_stats(db, victim)
                if beat > since and stats["requests"] > 0:
                    break
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            first = await asyncio.gather(*in_flight)
            failed = [cid for cid, r in zip(cids, first) if r.status_code != 200]
            for cid, r in zip(cids, first):
                if r.status_code == 200:
                    committed[cid] += 1
                else:  # a retryable error, nothing written
                    assert r.status_code == 503 and "retry-after" in r.headers, r.text
            seen = {cid: (owners[cid] == victim, r.status_code, r.text[:120]) for cid, r in zip(cids, first)}
            assert any(owners[cid] == victim for cid in failed), seen
            assert all(owners[cid] == victim for cid in failed), seen
            statuses = {}
            for cid in cids:  # every session goes on: a failed turn is retried, then one more turn
                for text in (["a long answer"] if cid in failed else []) + ["and then?"]:
                    for _attempt in range(60):
                        r = await _turn(c, cid, text)
                        if r.status_code != 503:
                            break
                        await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                    assert r.status_code == 200, r.text
                    committed[cid] += 1
                    statuses.setdefault(cid, r.json()["resume_status"])
            chains = {cid: (await c.get(f"/v1/chains/{cid}", params={"include_tokens": "true"})).json()
                      for cid in cids}
            return failed, committed, statuses, chains, victim
    failed, committed, statuses, chains, victim = asyncio.run(main())
    assert failed, "no turn was in flight on the killed replica"
    for cid, chain in chains.items():  # every committed turn, and nothing else, in the database and the token log
        assert chain["num_turns"] == len(chain["turns"]) == committed[cid]
        log = [t for turn in chain["turns"] for t in turn["appended_token_ids"] + turn["generated_token_ids"]]
        assert chain["token_ids"] == log
    for cid in failed:  # the killed replica's chains continue elsewhere, recomputed from their token log
        assert statuses[cid] == "recomputed"
    assert victim not in _db_owners(db).values()


def _replica_stats(db_path, replica: str) -> tuple[float, dict]:
    """(the time of the replica's last heartbeat, the load it reported)."""
    import json
    import sqlite3

    with sqlite3.connect(db_path) as conn:
        beat, stats = conn.execute("SELECT heartbeat_at, stats FROM engine_replicas WHERE id = ?",
                                   (replica,)).fetchone()
    return beat, json.loads(stats)


def _replica_pid(db_path, replica: str) -> int:
    return int(_replica_stats(db_path, replica)[1]["pid"])


def test_a_redeployment_drains_the_engine_replicas_and_their_chains_load_on_the_new_ones(ray_serve, tmp_path):
    """Deploying again (an upgrade; here also down to one replica) replaces the engine replicas one by one: each
    drained replica hands its idle chains off through the disk tier, and the new replica their next turn reaches
    loads them (only the new tokens are prefilled) instead of recomputing their history."""
    db = tmp_path / "drain.db"
    tiers = {"chain_host_bytes": 64 * 2**20, "chain_disk_dir": str(tmp_path / "chains"),
             "chain_disk_bytes": 256 * 2**20}
    _deploy(ray_serve, f"sqlite+aiosqlite:///{db}", **tiers)

    async def turns(cids, text):
        async with httpx.AsyncClient(base_url=ray_serve, timeout=300) as c:
            if not cids:
                cids.extend([(await c.post("/v1/chains", json={})).json()["id"] for _ in range(6)])
            rs = await asyncio.gather(*(_turn(c, cid, text) for cid in cids))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json() for r in rs]
    cids: list[str] = []
    asyncio.run(turns(cids, "first"))
    asyncio.run(turns(cids, "second"))
    before = set(_db_owners(db).values())
    assert len(before) == 2
    _deploy(ray_serve, f"sqlite+aiosqlite:///{db}", replicas=1, **tiers)
    (new,) = _live_replicas(db)
    assert new not in before
    for result in asyncio.run(turns(cids, "third")):
        usage = result["usage"]
        assert result["resume_status"] == "loaded", result
        assert usage["prefilled_tokens"] <= usage["appended_tokens"] + 1, usage
    assert set(_db_owners(db).values()) == {new}


def _live_replicas(db_path) -> list[str]:
    import sqlite3

    with sqlite3.connect(db_path) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM engine_replicas")]

