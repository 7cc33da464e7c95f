"""WebSocket limits and other boundary answers.

A WebSocket frame over ``max_body_size`` closes the socket with 1009 and a reason under uvicorn
(``ws_max_size``, as ``agentrt serve`` and LocalServer set it) and the server keeps serving; under a server that
hands such a message over, the handler answers it with a 413 error. A binary frame is answered that only text
frames are taken; an unknown field of a WebSocket turn request is named in ``extra[].key`` as on the HTTP route.
Also: ``/metrics`` has one charset, the SDK raises its own error when no server listens, and the
mini-swe-agent example runs commands in a scratch directory.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest
import yaml
from litestar.testing import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from agentrt.app import create_app
from agentrt.config import ServerConfig
from agentrt.local_server import LocalServer
from sdk import AgentrtConnectionError, AgentrtError, AsyncClient, Client
from tests.server_helpers import ENGINE_OPTIONS

TURN = {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2}}
REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(db_url=f"sqlite+aiosqlite:///{tmp_path / 'ws.db'}", engine_options=ENGINE_OPTIONS, **kw)


def _turn_over_ws(url: str) -> list[dict]:
    with ws_connect(url, max_size=None, open_timeout=60) as ws:
        ws.send(json.dumps(TURN))
        msgs = [json.loads(ws.recv(timeout=60))]
        while msgs[-1]["type"] == "delta":
            msgs.append(json.loads(ws.recv(timeout=60)))
    return msgs


def test_a_14mb_frame_closes_the_socket_with_1009_and_the_server_keeps_serving(tmp_path):
    with LocalServer(create_app(_config(tmp_path))) as server:  # max_body_size: 8 MiB
        assert server.server.config.ws_max_size == 8 * 2**20
        with httpx.Client(base_url=server.url, timeout=60) as http:
            cid = http.post("/v1/chains", json={}).json()["id"]
            url = server.url.replace("http", "ws") + f"/v1/chains/{cid}/ws"
            frame = json.dumps({**TURN, "assistant_prefix": "A" * 14_400_000})
            with ws_connect(url, max_size=None, open_timeout=60) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.send(frame)
                    ws.recv(timeout=60)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
            assert http.get("/health").status_code == 200
            assert _turn_over_ws(url)[-1]["type"] == "turn_end"
            assert http.get(f"/v1/chains/{cid}").json()["num_turns"] == 1  # the big frame ran nothing
        with Client(server.url, timeout=60) as client:  # the SDK names the close
            with pytest.raises(AgentrtConnectionError, match="closed the WebSocket .*code 1009"):
                list(client.chains.get(cid).stream("hi", assistant_prefix="A" * 9 * 2**20))


def test_a_message_over_the_limit_is_a_413_under_a_server_without_a_frame_limit(tmp_path):
    """Litestar's TestClient hands any message over: the handler refuses one over max_body_size, counted in
    UTF-8 bytes, as the POST route refuses such a body; nothing runs and the socket stays open."""
    with TestClient(base_url="http://127.0.0.1", app=create_app(_config(tmp_path, max_body_size=64 * 1024)), timeout=60) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        with http.websocket_connect(f"/v1/chains/{cid}/ws") as ws:
            ws.send_text(json.dumps({**TURN, "assistant_prefix": "é" * 40_000}, ensure_ascii=False))  # 80 kB, 40 k chars
            err = ws.receive_json()
            assert err["type"] == "error" and err["status_code"] == 413 and "max_body_size" in err["detail"], err
            assert http.get(f"/v1/chains/{cid}").json()["num_turns"] == 0
            ws.send_text(json.dumps(TURN))
            msgs = [ws.receive_json()]
            while msgs[-1]["type"] == "delta":
                msgs.append(ws.receive_json())
            assert msgs[-1]["type"] == "turn_end"


def test_binary_frames_are_refused_by_name_and_the_socket_stays_open(tmp_path):
    with TestClient(base_url="http://127.0.0.1", app=create_app(_config(tmp_path)), timeout=60) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        with http.websocket_connect(f"/v1/chains/{cid}/ws") as ws:
            ws.send_bytes(json.dumps(TURN).encode())
            err = ws.receive_json()
            assert err["type"] == "error" and err["status_code"] == 400
            assert "binary frames are not accepted" in err["detail"] and "truncated" not in err["detail"]
            ws.send_text(json.dumps(TURN))
            msgs = [ws.receive_json()]
            while msgs[-1]["type"] == "delta":
                msgs.append(ws.receive_json())
            assert msgs[-1]["type"] == "turn_end"


@pytest.mark.parametrize("body,key", [
    ({**TURN, "bogus": 1}, "bogus"),
    ({**TURN, "sampling": {"max_tokens": 2, "bogus": 1}}, "sampling.bogus"),
    ({"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "messages[0].bogus"),
    ({"sampling": {"max_tokens": 2}}, "messages"),
    ({**TURN, "sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
])
def test_websocket_field_errors_name_the_field_as_the_http_route_does(tmp_path, body, key):
    with TestClient(base_url="http://127.0.0.1", app=create_app(_config(tmp_path)), timeout=60) as http:
        cid = http.post("/v1/chains", json={}).json()["id"]
        r = http.post(f"/v1/chains/{cid}/turns", json=body)
        assert r.status_code == 400 and [d["key"] for d in r.json()["extra"]] == [key], r.text
        with http.websocket_connect(f"/v1/chains/{cid}/ws") as ws:
            ws.send_text(json.dumps(body))
            err = ws.receive_json()
        assert err["status_code"] == 400 and [d.get("key") for d in err["extra"]] == [key], err


def test_metrics_content_type_has_one_charset(tmp_path):
    with TestClient(base_url="http://127.0.0.1", app=create_app(_config(tmp_path)), timeout=60) as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].count("charset") == 1
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sdk_raises_its_own_error_when_no_server_listens():
    url = f"http://127.0.0.1:{_free_port()}"
    with Client(url, timeout=5) as client:
        with pytest.raises(AgentrtConnectionError) as err:
            client.chains.list()
    assert isinstance(err.value, AgentrtError) and err.value.status_code is None
    assert url in str(err.value) and err.value.url == url and isinstance(err.value.__cause__, httpx.ConnectError)

    async def run() -> AgentrtConnectionError:
        async with AsyncClient(url, timeout=5) as client:
            with pytest.raises(AgentrtConnectionError) as err:
                await client.health()
            return err.value

    assert url in str(asyncio.run(run()))


def test_the_sdk_stream_raises_its_own_error_when_the_server_goes(tmp_path):
    from sdk.client import Chain
    from sdk.schema import ChainRead, KVAccounting

    url = f"http://127.0.0.1:{_free_port()}"
    info = ChainRead(id="chain_x", created_at=0.0, model="m", method="dense", status="idle", num_turns=0,
                     num_tokens=0, metadata={}, method_config={}, system_prompt="", tools=[], turns=[], regions=[],
                     kv=KVAccounting(logical_tokens=0, resident=False))
    with Client(url, timeout=5) as client:
        with pytest.raises(AgentrtConnectionError, match="cannot reach the agentrt server at " + url):
            list(Chain(client, info).stream("hi"))


def test_the_mini_swe_example_runs_commands_in_a_scratch_directory():
    config = yaml.safe_load((REPO / "examples" / "mini_swe_agent.yaml").read_text())
    cwd = Path(config["environment"]["cwd"])
    assert cwd.is_absolute() and REPO not in cwd.parents and cwd != REPO
    assert f"mkdir -p {cwd}" in (REPO / "examples" / "mini_swe_agent.yaml").read_text()
