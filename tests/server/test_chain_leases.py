"""Chain leases (agentrt.scaleout.leases) on a real database, and the chain-affinity routing rules
(agentrt.scaleout.router) on stand-in replicas: the parts of scale-out that decide who runs a chain, checked
without a Ray cluster (tests/server/test_scaleout.py runs them together)."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest

from agentrt.db import open_database
from agentrt.errors import ChainBusy
from agentrt.scaleout.leases import ChainLeases, LeaseLost


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path / 'leases.db'}"


def run(coro):
    return asyncio.run(coro)


async def check_one_holder_at_a_time(db_url: str) -> None:
    db = await open_database(db_url)
    c1, c2, c3 = (f"{uuid.uuid4().hex}-{i}" for i in range(3))
    a, b = ChainLeases(db, "http-a"), ChainLeases(db, "http-b")
    lease = await a.acquire(c1)
    assert (lease.epoch, lease.owner) == (1, None)
    with pytest.raises(ChainBusy):
        await b.acquire(c1)
    again = await a.acquire(c1)  # the same holder: its release had not landed (a retry); the old epoch dies
    assert again.epoch == 2
    await a.release(lease)  # the late release of the old epoch changes nothing
    with pytest.raises(ChainBusy):
        await b.acquire(c1)
    with pytest.raises(LeaseLost):
        async with db.sessions.begin() as s:
            await a.fence(s, lease, "engine-0")
    async with db.sessions.begin() as s:  # more work follows (a pruning policy): the lease stays
        await a.fence(s, again, "engine-1", release=False)
    assert await b.owner(c1) == "engine-1"
    with pytest.raises(ChainBusy):
        await b.acquire(c1)
    async with db.sessions.begin() as s:
        await a.fence(s, again, None)
    assert await b.owner(c1) == "engine-1"
    second = await b.acquire(c1)  # released by the commit
    assert (second.epoch, second.owner) == (3, "engine-1")
    await b.release(second)  # a failed turn: the owner stays
    assert await a.owner(c1) == "engine-1"
    await a.set_owner(c2, "engine-2")  # a fork's copy
    assert await b.owner(c2) == "engine-2" and await b.owner(c3) is None
    await a.forget(c1)
    assert await a.owner(c1) is None
    await db.dispose()


async def check_an_expired_lease_is_taken_over(db_url: str) -> None:
    db = await open_database(db_url)
    chain = uuid.uuid4().hex
    stalled, other = ChainLeases(db, "http-a", ttl_s=0.3), ChainLeases(db, "http-b")
    old = await stalled.acquire(chain)
    ChainLeases._stop(old)  # a holder that stopped renewing (partitioned, stuck)
    await asyncio.sleep(0.4)
    new = await other.acquire(chain)
    assert new.epoch == old.epoch + 1
    with pytest.raises(LeaseLost):
        async with db.sessions.begin() as s:
            await stalled.fence(s, old, "engine-1")
    async with db.sessions.begin() as s:
        await other.fence(s, new, "engine-2")
    assert await other.owner(chain) == "engine-2"
    await db.dispose()


async def check_concurrent_acquires_grant_one(db_url: str) -> None:
    db = await open_database(db_url)
    chain = uuid.uuid4().hex
    holders = [ChainLeases(db, f"http-{i}") for i in range(8)]
    results = await asyncio.gather(*(h.acquire(chain) for h in holders), return_exceptions=True)
    granted = [r for r in results if not isinstance(r, BaseException)]
    assert len(granted) == 1 and all(isinstance(r, ChainBusy) for r in results if r not in granted), results
    for r in granted:
        ChainLeases._stop(r)
    await db.dispose()


CHECKS = (check_one_holder_at_a_time, check_an_expired_lease_is_taken_over, check_concurrent_acquires_grant_one)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_leases_on_sqlite(check, db_url):
    run(check(db_url))  # tests/server/test_postgres.py runs the same checks on PostgreSQL


def test_a_renewed_lease_outlives_its_ttl(db_url):
    async def main():
        db = await open_database(db_url)
        holder, other = ChainLeases(db, "http-a", ttl_s=0.3), ChainLeases(db, "http-b")
        lease = await holder.acquire("c1")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # three TTLs: only renewals keep it
            with pytest.raises(ChainBusy):
                await other.acquire("c1")
            await asyncio.sleep(0.1)
        await holder.release(lease)
        taken = await other.acquire("c1")  # free once released
        ChainLeases._stop(taken)
        await db.dispose()
    run(main())


# --- routing rules (Ray's types are imported inside: tests/server/test_postgres.py imports this module) ------------


def _replica(name: str, requests: int = 0, pages_free: int = 100):
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID("engine", "agentrt")), routing_stats={
        "requests": requests, "pages_free": pages_free})


def _router(affinity: bool = True, imbalance: int = 8):
    from agentrt.scaleout.router import ChainAffinityRouter

    router = object.__new__(ChainAffinityRouter)  # the routing rules only; Ray's machinery is not needed
    router.initialize_state(affinity=affinity, imbalance=imbalance)
    return router


def _choose(router, replicas, **kwargs):
    request = SimpleNamespace(kwargs=kwargs)
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_chain_goes_to_its_owner_however_loaded():
    a, b = _replica("a", requests=50, pages_free=1), _replica("b")
    assert _choose(_router(), [a, b], replica="a") == [["a"]]


def test_a_gone_owner_or_a_new_chain_goes_to_the_least_loaded():
    a, b, c = _replica("a", requests=3), _replica("b", requests=1, pages_free=10), _replica("c", requests=1)
    assert _choose(_router(), [a, b, c], replica="dead") == [["c"], ["b"], ["a"]]  # fewer requests, then more pages
    assert _choose(_router(), [a, b, c]) == [["c"], ["b"], ["a"]]


def test_what_this_router_sent_counts_before_the_replicas_report_it():
    router = _router()
    a, b = _replica("a"), _replica("b", pages_free=50)
    assert _choose(router, [a, b])[0] == ["a"]
    router.on_request_routed(None, a.replica_id, None)
    router.on_request_routed(None, a.replica_id, None)
    assert _choose(router, [a, b])[0] == ["b"]
    router.on_request_completed(a.replica_id, "r1")
    router.on_request_completed(a.replica_id, "r2")
    assert _choose(router, [a, b])[0] == ["a"]


def test_stateless_requests_follow_their_prefix_until_it_is_overloaded():
    from agentrt.scaleout.router import prefix_key

    replicas = [_replica(n) for n in "abcd"]
    keys = [prefix_key([i, 7, 7, 7]) for i in range(40)]
    picks = [_choose(_router(), replicas, prefix=k)[0][0] for k in keys]
    assert picks == [_choose(_router(), list(reversed(replicas)), prefix=k)[0][0] for k in keys]  # order-free
    assert len(set(picks)) == 4  # prefixes spread over the replicas
    assert prefix_key([1, 2, 3] + [9] * 100) == prefix_key([1, 2, 3] + [9] * 61 + [5] * 39)  # the first 64 tokens
    busy = {p: _replica(p, requests=20) if p == picks[0] else _replica(p) for p in "abcd"}
    assert _choose(_router(imbalance=8), list(busy.values()), prefix=keys[0])[0] != [picks[0]]
    assert _choose(_router(imbalance=30), list(busy.values()), prefix=keys[0])[0] == [picks[0]]


def test_without_affinity_the_owner_is_ignored():
    replicas = [_replica("a"), _replica("b")]
    seen = {_choose(_router(affinity=False), replicas, replica="a")[0][0] for _ in range(64)}
    assert seen == {"a", "b"}
