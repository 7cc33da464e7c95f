"""Method-configuration slots: one tenant cannot lock the others out of per-chain methods.

The engine serves at most ``max_methods`` (method, config) pairs at once, its own included. A configuration a
chain names holds a slot while a chain (or a running request) uses it, and gives it back when its last chain
is deleted; each tenant may use at most ``max_method_configs_per_tenant`` of them (429 naming
``method_config``); a server restarted on the same database takes on again the configurations of the chains
it holds. The engine-level test shows a slot is not freed under a running request.
"""

from __future__ import annotations

import asyncio

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.auth import KeyService
from agentrt.config import ServerConfig
from agentrt.db import open_database
from engine.errors import ConfigError
from tests.server_helpers import ENGINE_OPTIONS

SAMPLING = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
TENANTS = ("alice", "bob", "carol")


def snapkv(budget: int) -> dict:
    return {"method": "snapkv", "method_config": {"budget": budget, "window": 8}}


def make_keys(db_url: str) -> dict[str, dict[str, str]]:
    """A bearer header per tenant, keys made through the service ``agentrt keys create`` uses."""
    async def run() -> dict[str, dict[str, str]]:
        db = await open_database(db_url)
        try:
            service = KeyService(db)
            return {t: {"Authorization": f"Bearer {(await service.create(t)).key}"} for t in TENANTS}
        finally:
            await db.dispose()

    return asyncio.run(run())


@pytest.fixture()
def db_url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path / 'slots.db'}"


@pytest.fixture()
def keys(db_url):
    return make_keys(db_url)


def server(db_url: str, max_methods: int = 3, **config) -> TestClient:
    """The default (dense) plus ``max_methods - 1`` slots for chains' own configurations."""
    options = {**ENGINE_OPTIONS, "max_methods": max_methods}
    return TestClient(base_url="http://127.0.0.1", app=create_app(ServerConfig(db_url=db_url, engine_options=options, require_auth=True,
                                                  **config)), timeout=120)


def create(client, who: dict, body: dict, status: int = 201) -> dict:
    r = client.post("/v1/chains", json=body, headers=who)
    assert r.status_code == status, r.text
    return r.json()


def turn(client, who: dict, cid: str) -> dict:
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "hello " * 8}],
                                                     "sampling": SAMPLING}, headers=who)
    assert r.status_code == 200, r.text
    return r.json()


def engine_configs(client) -> set[tuple[str, int]]:
    """The (method, budget) pairs the engine has taken on besides its own."""
    engine = client.app.state.worker.engine
    return {(m.name, m.config.budget) for m in engine.methods if m is not engine.method}


def keys_of(r_json: dict) -> list[str | None]:
    return [d.get("key") for d in r_json.get("extra") or []]


def test_deleted_chains_give_their_slots_to_another_tenant(db_url, keys):
    alice, bob = keys["alice"], keys["bob"]
    with server(db_url) as c:
        mine = [create(c, alice, snapkv(b))["id"] for b in (32, 40)]
        full = create(c, bob, snapkv(48), status=400)  # both slots are alice's while her chains live
        assert "method_config" in keys_of(full) and "max_methods" in full["detail"]
        for cid in mine:
            assert c.delete(f"/v1/chains/{cid}", headers=alice).status_code == 204
        assert engine_configs(c) == set()
        theirs = [create(c, bob, snapkv(b)) for b in (48, 56)]  # both slots again, for bob
        assert [t["method_config"]["budget"] for t in theirs] == [48, 56]
        assert turn(c, bob, theirs[0]["id"])["finish_reason"] == "length"
        assert engine_configs(c) == {("snapkv", 48), ("snapkv", 56)}


def test_a_slot_in_use_by_a_live_chain_is_not_freed(db_url, keys):
    """Deleting chains frees the slot of a configuration no chain uses any more, not of one a chain still uses
    (the same configuration's other chains, a fork, are deleted around it)."""
    alice, bob = keys["alice"], keys["bob"]
    with server(db_url) as c:
        live = create(c, alice, snapkv(32))["id"]
        assert turn(c, alice, live)["resume_status"] == "created"
        engine = c.app.state.worker.engine
        (instance,) = [m for m in engine.methods if m is not engine.method]
        other = create(c, alice, snapkv(32))["id"]  # the same configuration: the same slot
        forked = c.post(f"/v1/chains/{live}/fork", json={}, headers=alice)
        assert forked.status_code == 201, forked.text
        temp = create(c, alice, snapkv(40))["id"]
        for cid in (other, forked.json()["id"], temp):
            assert c.delete(f"/v1/chains/{cid}", headers=alice).status_code == 204
        create(c, bob, snapkv(48))  # the slot of 40, whose only chain is gone
        assert "method_config" in keys_of(create(c, bob, snapkv(56), status=400))  # 32 is still held
        assert [m for m in engine.methods if m is not engine.method and m.config.budget == 32] == [instance]
        assert turn(c, alice, live)["resume_status"] == "resumed"  # its method (and KV) stayed


def test_the_per_tenant_limit_is_a_429_naming_method_config(db_url, keys):
    alice, bob = keys["alice"], keys["bob"]
    with server(db_url, max_methods=8, max_method_configs_per_tenant=2) as c:
        with32 = [create(c, alice, snapkv(32))["id"]]
        create(c, alice, snapkv(40))
        r = c.post("/v1/chains", json=snapkv(48), headers=alice)
        assert r.status_code == 429, r.text
        assert keys_of(r.json()) == ["method_config"] and "max_method_configs_per_tenant" in r.json()["detail"]
        with32.append(create(c, alice, snapkv(32))["id"])  # a configuration she already uses is no new one
        create(c, alice, {})  # nor is the server's
        create(c, bob, snapkv(48))  # the limit is per tenant
        assert ("snapkv", 48) in engine_configs(c)
        for cid in with32:
            assert c.delete(f"/v1/chains/{cid}", headers=alice).status_code == 204
        create(c, alice, snapkv(56))  # her budget-32 chains are gone: she may use another configuration


def test_a_restarted_server_takes_on_the_methods_of_its_chains_again(db_url, keys):
    alice, bob = keys["alice"], keys["bob"]
    with server(db_url) as c:
        cid = create(c, alice, snapkv(32))["id"]
        turn(c, alice, cid)
    with server(db_url) as c:  # a new engine on the same database
        assert engine_configs(c) == {("snapkv", 32)}
        create(c, bob, snapkv(40))
        assert "method_config" in keys_of(create(c, bob, snapkv(48), status=400))  # alice's chain holds one
        assert turn(c, alice, cid)["resume_status"] == "recomputed"
        assert c.delete(f"/v1/chains/{cid}", headers=alice).status_code == 204
        create(c, bob, snapkv(48))


def test_a_retained_configuration_outlives_its_release_while_a_request_runs_it(tmp_path):
    """Engine level: a release while a request of the configuration runs frees nothing until the request is
    gone; then the slot serves another configuration, and the same knobs taken on again are a new instance
    under a new prefix namespace."""
    from agentrt.config import embedded_model_dir
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(embedded_model_dir(), max_methods=2, **ENGINE_OPTIONS))
    a, b = snapkv(32)["method_config"], snapkv(40)["method_config"]
    assert engine.retain_method("snapkv", a) == "snapkv"
    instance = engine.methods.resolve("snapkv", a)
    namespace = engine.methods.prefix_namespace(instance)
    rid = engine.add_request(list(range(5, 45)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             method="snapkv", method_config=a)
    engine.step()
    engine.release_method("snapkv", a)
    assert instance in engine.methods  # the running request holds it
    with pytest.raises(ConfigError, match="max_methods"):
        engine.retain_method("snapkv", b)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert len(done) == 1 and len(done[0].token_ids) == 6
    assert instance not in engine.methods
    engine.retain_method("snapkv", b)  # the freed slot
    engine.release_method("snapkv", b)
    again = engine.methods.retain("snapkv", a)
    assert again is not instance and engine.methods.prefix_namespace(again) != namespace


def test_configurations_taken_on_without_retain_stay(tmp_path):
    """A request (or check_method) alone takes a configuration on for the engine's life, as before: a release
    of it changes nothing."""
    from agentrt.config import embedded_model_dir
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(embedded_model_dir(), max_methods=3, **ENGINE_OPTIONS))
    a = snapkv(32)["method_config"]
    engine.check_method("snapkv", a)
    instance = engine.methods.resolve("snapkv", a)
    engine.retain_method("snapkv", a)
    engine.release_method("snapkv", a)
    engine.release_method("snapkv", a)
    assert instance in engine.methods
