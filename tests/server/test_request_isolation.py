"""One client cannot stall the others, and a keyless loopback server answers only to loopback names.

The stall test measures latency, which the suite otherwise leaves to benchmarks: the bound (1 s against
multi-second stalls when rendering ran on the event loop) is what the server promises its other clients.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from litestar.testing import TestClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.host_guard import host_name
from agentrt.render_pool import RenderPool
from tests.live_servers import agentrt_serve
from tests.server_helpers import ENGINE_OPTIONS

SMALL_TURN = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 4}}


def _config(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(db_url=f"sqlite+aiosqlite:///{tmp_path / 'iso.db'}", engine_options=ENGINE_OPTIONS, **kw)


# --- the Host allow-list -----------------------------------------------------------------------------------

@pytest.mark.parametrize("header, name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"),
                                          ("127.0.0.1", "127.0.0.1"), ("Evil.Example:80", "evil.example")])
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    with TestClient(base_url="http://127.0.0.1", app=create_app(_config(tmp_path_factory.mktemp("keyless"))),
                    timeout=60) as client:
        yield client


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_keyless_server_refuses_other_host_names(keyless, host):
    before = len(keyless.get("/v1/chains").json()["data"])
    r = keyless.post("/v1/chains", json={}, headers={"Host": host})
    assert r.status_code == 400 and "Host" in r.json()["detail"] and "--allowed-host" in r.json()["detail"], r.text
    r = keyless.post("/v1/chat/completions", headers={"Host": host},
                     json={"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"], r.text  # OpenAI's shape there
    assert len(keyless.get("/v1/chains").json()["data"]) == before


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:9", "127.0.0.2", "[::1]:8000",
                                  "app.localhost"])
def test_a_keyless_server_answers_loopback_names(keyless, host):
    assert keyless.get("/health", headers={"Host": host}).status_code == 200
    assert keyless.post("/v1/chains", json={}, headers={"Host": host}).status_code == 201


def test_a_websocket_from_another_host_is_refused(keyless):
    cid = keyless.post("/v1/chains", json={}).json()["id"]
    with pytest.raises(Exception):
        with keyless.websocket_connect(f"/v1/chains/{cid}/ws", headers={"Host": "evil.example"}) as ws:
            ws.send_text(json.dumps(SMALL_TURN))
            ws.receive_text()


def test_allowed_hosts_are_configurable(tmp_path):
    config = _config(tmp_path, allowed_hosts=("agents.internal",))
    with TestClient(base_url="http://agents.internal", app=create_app(config), timeout=60) as client:
        assert client.post("/v1/chains", json={}).status_code == 201
        assert client.post("/v1/chains", json={}, headers={"Host": "localhost"}).status_code == 400
    assert _config(tmp_path, allowed_hosts=("*",)).host_allow_list is None
    assert _config(tmp_path, require_auth=True).host_allow_list is None  # keys protect a server with auth


# --- rendering off the event loop ------------------------------------------------------------------------

def test_a_request_larger_than_the_context_can_hold_is_413_before_rendering(tmp_path):
    pool = RenderPool(renderer=None, max_model_len=100, chars_per_token=4)  # type: ignore[arg-type]
    pool.check_size([{"role": "user", "content": "x" * 300}])
    with pytest.raises(Exception) as err:
        pool.check_size([{"role": "user", "content": "x" * 400}])
    assert err.value.status_code == 413 and err.value.extra[0]["key"] == "messages"


class Prober:
    """Another client: /health and 4-token turns, back to back, recording each call's latency; and a third that
    polls /health alone (``health``), so the event loop is sampled also while a turn of the second waits."""

    def __init__(self, url: str):
        self.url, self.latencies, self.errors = url, [], []
        self.health: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True),
                        threading.Thread(target=self._poll_health, daemon=True)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            cid = http.post("/v1/chains", json={}).json()["id"]
            while not self.stop.is_set():
                for method, path, body in (("GET", "/health", None), ("POST", f"/v1/chains/{cid}/turns", SMALL_TURN)):
                    t0 = time.perf_counter()
                    r = http.request(method, path, json=body)
                    self.latencies.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        self.errors.append((path, r.status_code, r.text[:200]))

    def _poll_health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                r = http.get("/health")
                self.health.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    self.errors.append(("/health", r.status_code, r.text[:200]))
                time.sleep(0.02)

    def __enter__(self) -> "Prober":
        for thread in self.threads:
            thread.start()
        while not self.latencies or not self.health:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`agentrt serve` in a process of its own: the clients' work here must not share its interpreter."""
    with agentrt_serve(tmp_path_factory.mktemp("served")) as (url, _):
        yield url


def test_a_huge_turn_does_not_stall_other_clients(served):
    huge = {"messages": [{"role": "user", "content": "word " * 1400}] * 1024, "sampling": {"max_tokens": 1}}
    # under the size limit, but hundreds of template renders: seconds of work, off the event loop
    heavy = {"messages": [{"role": "user", "content": "word " * 12}] * 1000, "sampling": {"max_tokens": 1}}
    bodies = [json.dumps(b).encode() for b in (huge, heavy, {"model": "qwen3-tiny", **heavy, "max_tokens": 1})]
    assert len(bodies[0]) > 7_000_000
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=served, timeout=120) as big, Prober(served) as prober:
        cid = big.post("/v1/chains", json={}).json()["id"]
        t0 = time.perf_counter()
        r = big.post(f"/v1/chains/{cid}/turns", content=bodies[0], headers=headers)
        assert r.status_code == 413 and r.json()["extra"][0]["key"] == "messages", r.text[:300]
        r = big.post(f"/v1/chains/{cid}/turns", content=bodies[1], headers=headers)
        heavy_s = time.perf_counter() - t0
        assert r.status_code in (200, 422), r.text[:300]  # a result, or the engine's context refusal
        r = big.post("/v1/chat/completions", content=bodies[2], headers=headers)
        assert r.status_code in (200, 400), r.text[:300]
        assert not prober.errors, prober.errors[:3]
        # the event loop never waits on the render (/health answers at once throughout), and another client's
        # turns go on: the engine thread's GIL take-backs wait at most the server's short switch interval
        assert len(prober.health) > 20 and max(prober.health) < 1.0, (max(prober.health), heavy_s)
        assert len(prober.latencies) > 4 and max(prober.latencies) < 1.0, (max(prober.latencies), heavy_s)


def test_a_14mb_websocket_frame_does_not_stall_other_clients(served):
    with httpx.Client(base_url=served, timeout=60) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        url = served.replace("http", "ws") + f"/v1/chains/{cid}/ws"
        frame = json.dumps({**SMALL_TURN, "assistant_prefix": "A" * 14_400_000})
        with Prober(served) as prober:
            with ws_connect(url, max_size=None, open_timeout=60) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.send(frame)
                    ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        assert not prober.errors, prober.errors[:3]
        assert max(prober.latencies) < 1.0, max(prober.latencies)
