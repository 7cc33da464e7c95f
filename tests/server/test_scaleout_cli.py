"""`agentrt serve --replicas 2` as a user runs it: its own process starts a local Ray instance with two engine
replicas behind the HTTP proxy; chains' turns resume on their owner; Ctrl-C (SIGINT) stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_replicas_routes_chains_to_their_owner(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--replicas", "2", "--port", str(port),
                             "--db", f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}", "--device", "cpu",
                             "--num-pages", "256"], cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if "agentrt_replicas 2.0" in httpx.get(url + "/metrics", timeout=5).text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=120) as c:
            for _ in range(3):
                cid = c.post("/v1/chains", json={}).json()["id"]
                statuses = []
                for step in range(3):
                    r = c.post(f"/v1/chains/{cid}/turns", json={"sampling": {"temperature": 0.0, "max_tokens": 4},
                                                                "messages": [{"role": "user", "content": f"{step}"}]})
                    assert r.status_code == 200, r.text
                    statuses.append(r.json()["resume_status"])
                assert statuses == ["created", "resumed", "resumed"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, log.read_text()[-4000:]
