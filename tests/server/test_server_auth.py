"""API keys, tenant isolation and the server's limits, against the real app (Litestar's TestClient)."""

from __future__ import annotations

import asyncio
import json

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.auth import KeyService
from agentrt.config import ConfigurationError, ServerConfig
from agentrt.db import open_database
from agentrt.models import ApiKeyRow
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS, WEATHER_TOOL, bearer, make_keys

SAMPLING = {"temperature": 0.0, "max_tokens": 4}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db') / 'auth.db'}"


@pytest.fixture(scope="module")
def keys(db_url):
    return make_keys(db_url, "alice", "bob", "carol", "revoked")


@pytest.fixture(scope="module")
def client(db_url, keys):
    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS, require_auth=True,
                          max_chains_per_tenant=3, max_body_size=64 * 1024, max_tokens_per_turn=16)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        yield c


def _chain(client, key) -> str:
    r = client.post("/v1/chains", json={"tools": [WEATHER_TOOL]}, headers=bearer(key))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_keys_are_stored_hashed(db_url, keys):
    async def rows() -> list[ApiKeyRow]:
        db = await open_database(db_url)
        try:
            return await KeyService(db).list()
        finally:
            await db.dispose()

    stored = asyncio.run(rows())
    assert {r.tenant for r in stored} >= set(keys)
    for row in stored:
        for key in keys.values():
            secret = key.split("_", 2)[2].encode()
            assert secret not in row.key_hash and secret not in row.salt and len(row.key_hash) == 32


def test_requests_without_a_valid_key_are_401(client, keys):
    for headers in ({}, {"Authorization": "Basic Zm9vOmJhcg=="}, bearer("sk-not-ours"),
                    bearer("art_0123456789abcdef_" + "x" * 43), bearer(keys["alice"] + "x")):
        r = client.get("/v1/chains", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["status_code"] == 401
    # the guard runs before the body is parsed: no validation detail leaks without a key
    assert client.post("/v1/chains", content=b"{not json", headers={"Content-Type": "application/json"}).status_code \
        == 401
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 401


def test_websocket_handshake_without_a_valid_key_is_401(client, db_url, keys):
    """The handshake is refused with the HTTP route's status and body (ASGI's WebSocket Denial Response under
    uvicorn); a server without that extension gets a close before accept, code 4000 + the status."""
    from litestar.exceptions import WebSocketDisconnect
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from agentrt.local_server import LocalServer

    with pytest.raises(WebSocketDisconnect) as closed:  # Litestar's TestClient offers no denial extension
        with client.websocket_connect("/v1/chains/chain_x/ws"):
            pass
    assert closed.value.code == 4401 and "API key is required" in closed.value.detail

    config = ServerConfig(model=random_model_dir(), db_url=db_url, engine_options=ENGINE_OPTIONS, require_auth=True)
    with LocalServer(create_app(config)) as server:
        url = f"ws://127.0.0.1:{server.port}/v1/chains/chain_x/ws"
        for headers, detail in (({}, "an API key is required"), (bearer("art_0123456789abcdef_" + "x" * 43),
                                                                  "invalid or revoked API key")):
            with pytest.raises(InvalidStatus) as refused:
                with connect(url, additional_headers=headers, open_timeout=30):
                    pass
            response = refused.value.response
            assert response.status_code == 401, response
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert response.headers["Content-Type"] == "application/json"
            body = json.loads(response.body)
            assert body["status_code"] == 401 and body["detail"].startswith(detail), body
        with connect(url, additional_headers=bearer(keys["alice"]), open_timeout=30) as ws:  # a key: accepted
            ws.send('{"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2}}')
            assert json.loads(ws.recv(timeout=30)) == {"type": "error", "status_code": 404,
                                                       "detail": "no chain 'chain_x'"}


def test_a_revoked_key_stops_working(client, keys):
    assert client.get("/v1/chains", headers=bearer(keys["revoked"])).status_code == 200
    key_id = keys["revoked"].split("_")[1]
    assert client.blocking_portal.call(client.app.state.api_keys.revoke, key_id) is True
    assert client.get("/v1/chains", headers=bearer(keys["revoked"])).status_code == 401


def test_tenants_are_isolated(client, keys):
    alice, bob = bearer(keys["alice"]), bearer(keys["bob"])
    cid = _chain(client, keys["alice"])
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": SAMPLING}, headers=alice)
    assert r.status_code == 200, r.text
    before = client.get(f"/v1/chains/{cid}?include_tokens=true", headers=alice).json()

    # bob sees nothing of it: every route answers 404, exactly as for an id that does not exist
    missing = "chain_" + "0" * 32
    for chain_id in (cid, missing):
        answers = [
            client.get(f"/v1/chains/{chain_id}", headers=bob),
            client.delete(f"/v1/chains/{chain_id}", headers=bob),
            client.post(f"/v1/chains/{chain_id}/turns", json={"messages": USER, "sampling": SAMPLING}, headers=bob),
            client.post(f"/v1/chains/{chain_id}/prune", json={"intervals": [[0, 4]]}, headers=bob),
            client.post(f"/v1/chains/{chain_id}/fork", headers=bob),
            client.post(f"/v1/chains/{chain_id}/rewind", json={"num_turns": 0}, headers=bob),
        ]
        assert [a.status_code for a in answers] == [404] * len(answers), [a.text for a in answers]
        assert {a.json()["detail"] for a in answers} == {f"no chain {chain_id!r}"}
    with client.websocket_connect(f"/v1/chains/{cid}/ws", headers=bob) as ws:
        ws.send_text('{"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2}}')
        assert ws.receive_json() == {"type": "error", "status_code": 404, "detail": f"no chain {cid!r}"}
    listed = client.get("/v1/chains", headers=bob).json()
    assert cid not in [c["id"] for c in listed["data"]]
    assert all(client.get(f"/v1/chains/{c['id']}", headers=alice).status_code == 404 for c in listed["data"])

    # alice's chain is untouched and still hers
    after = client.get(f"/v1/chains/{cid}?include_tokens=true", headers=alice).json()
    assert after["token_ids"] == before["token_ids"] and after["num_turns"] == 1
    assert cid in [c["id"] for c in client.get("/v1/chains?limit=100", headers=alice).json()["data"]]
    fork = client.post(f"/v1/chains/{cid}/fork", headers=alice)
    assert fork.status_code == 201 and client.get(f"/v1/chains/{fork.json()['id']}", headers=bob).status_code == 404
    assert client.delete(f"/v1/chains/{fork.json()['id']}", headers=alice).status_code == 204
    assert client.delete(f"/v1/chains/{cid}", headers=alice).status_code == 204


def test_chains_per_tenant_limit(client, keys):
    carol = keys["carol"]
    ids = [_chain(client, carol) for _ in range(3)]
    r = client.post("/v1/chains", json={}, headers=bearer(carol))
    assert r.status_code == 429 and "limit of" not in r.text and "3 chains" in r.json()["detail"]
    assert client.post(f"/v1/chains/{ids[0]}/fork", headers=bearer(carol)).status_code == 429
    _chain(client, keys["bob"])  # another tenant is not affected
    assert client.delete(f"/v1/chains/{ids[0]}", headers=bearer(carol)).status_code == 204
    _chain(client, carol)


def test_max_tokens_per_turn_and_body_size(client, keys):
    bob = bearer(keys["bob"])
    cid = _chain(client, keys["bob"])
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": {"max_tokens": 17}}, headers=bob)
    assert r.status_code == 400 and r.json()["extra"][0]["key"] == "sampling.max_tokens", r.text
    big = [{"role": "user", "content": "x" * (70 * 1024)}]
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": big}, headers=bob)
    assert r.status_code == 413, r.text
    assert client.get(f"/v1/chains/{cid}", headers=bob).json()["num_turns"] == 0


def test_overloaded_engine_is_503_with_retry_after(client, keys):
    bob = bearer(keys["bob"])
    cid = _chain(client, keys["bob"])
    worker = client.app.state.worker
    bound = worker.max_queue_depth
    worker.max_queue_depth = 0
    try:
        r = client.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": SAMPLING}, headers=bob)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert "overloaded" in r.json()["detail"]
        r = client.post("/v1/chat/completions", json={"model": client.app.state.model_name, "messages": USER, "max_tokens": 2},
                        headers=bob)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert client.get(f"/v1/chains/{cid}", headers=bob).json()["status"] == "idle"
    finally:
        worker.max_queue_depth = bound
    r = client.post(f"/v1/chains/{cid}/turns", json={"messages": USER, "sampling": SAMPLING}, headers=bob)
    assert r.status_code == 200, r.text
    assert not worker.inflight


def test_no_auth_only_on_loopback():
    assert not ServerConfig(host="127.0.0.1").auth_required
    assert not ServerConfig(host="::1").auth_required and not ServerConfig(host="localhost").auth_required
    assert ServerConfig(host="0.0.0.0").auth_required and ServerConfig(host="10.1.2.3").auth_required
    ServerConfig(host="0.0.0.0").check()
    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        with pytest.raises(ConfigurationError, match="not a loopback address"):
            ServerConfig(host=host, require_auth=False).check()
        with pytest.raises(ConfigurationError):
            create_app(ServerConfig(host=host, require_auth=False))
