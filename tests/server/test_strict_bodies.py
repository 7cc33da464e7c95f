"""HTTP bodies are read with the WebSocket's strict rules (no "10" for an int, no 0 for a bool) and must be JSON."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from agentrt.app import create_app
from agentrt.config import ServerConfig
from engine.tiny_checkpoint import random_model_dir
from tests.server_helpers import ENGINE_OPTIONS

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    db = tmp_path_factory.mktemp("strict") / "s.db"
    config = ServerConfig(model=random_model_dir(), db_url=f"sqlite+aiosqlite:///{db}", engine_options=ENGINE_OPTIONS)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def chain(client):
    r = client.post("/v1/chains", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.mark.parametrize("sampling, key", [
    ({"max_tokens": "2"}, "sampling.max_tokens"),
    ({"max_tokens": 2e0}, "sampling.max_tokens"),
    ({"ignore_eos": "false"}, "sampling.ignore_eos"),
    ({"ignore_eos": 0}, "sampling.ignore_eos"),
    ({"temperature": "0"}, "sampling.temperature"),
])
def test_a_coercible_value_is_a_400_naming_the_field_on_the_chain_routes(client, chain, sampling, key):
    r = client.post(f"/v1/chains/{chain}/turns", json={"messages": USER, "sampling": sampling})
    assert r.status_code == 400, r.text
    assert [e["key"] for e in r.json()["extra"]] == [key]
    assert client.get(f"/v1/chains/{chain}").json()["num_turns"] == 0  # nothing was run


def test_stream_must_be_a_bool(client, chain):
    r = client.post(f"/v1/chains/{chain}/turns", json={"messages": USER, "stream": 0})
    assert r.status_code == 400 and r.json()["extra"][0]["key"] == "stream", r.text


def test_the_same_values_as_json_types_pass(client, chain):
    r = client.post(f"/v1/chains/{chain}/turns", json={"messages": USER, "stream": False,
                                                        "sampling": {"max_tokens": 2, "ignore_eos": False}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers, content", [
    ({"Content-Type": "text/plain"}, b"{}"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"a=1"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n"),
    ({}, b"{}"),
])
def test_a_body_that_is_not_json_is_415(client, headers, content):
    before = len(client.get("/v1/chains").json()["data"])
    r = client.post("/v1/chains", content=content, headers=headers)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["detail"]
    assert len(client.get("/v1/chains").json()["data"]) == before


def test_a_json_suffix_type_and_a_charset_are_json(client):
    for media in ("application/json; charset=utf-8", "application/merge-patch+json"):
        r = client.post("/v1/chains", content=b"{}", headers={"Content-Type": media})
        assert r.status_code == 201, (media, r.text)


def test_a_fork_without_a_body_needs_no_content_type(client, chain):
    r = client.post(f"/v1/chains/{chain}/fork")
    assert r.status_code == 201, r.text


def test_the_openai_route_is_strict_too_in_openais_shape(client):
    body = {"model": "qwen3-tiny", "messages": USER, "max_tokens": "2"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = client.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_an_openai_request_without_max_tokens_fits_a_small_per_turn_limit(tmp_path):
    config = ServerConfig(model=random_model_dir(), model_name="m", db_url=f"sqlite+aiosqlite:///{tmp_path}/s.db",
                          engine_options=ENGINE_OPTIONS, max_tokens_per_turn=4)
    with TestClient(base_url="http://127.0.0.1", app=create_app(config), timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
        # more than the limit, as agent clients ask: lowered to it, the reply cut there
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 32000,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
