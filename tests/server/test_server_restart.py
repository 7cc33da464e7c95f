"""A real `agentrt serve` process: 3 turns, kill -9, restart on the same database, the 4th turn recomputes.

The key is created with the CLI (`agentrt keys create`) and the server runs with `--require-auth`, so the key,
the tenant and the chain all have to survive the crash.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server_helpers import TOOL_CALL, WEATHER_TOOL

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = {"temperature": 0.0, "max_tokens": 6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(db_url: str, port: int, log: Path) -> subprocess.Popen:
    out = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--db", db_url,
                             "--device", "cpu", "--require-auth"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_up(proc: subprocess.Popen, url: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the server did not come up:\n{log.read_text()}")


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_kill_9_and_restart_keeps_chains_turns_and_regions(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'restart.db'}"
    log = tmp_path / "server.log"
    created = subprocess.run([sys.executable, "-m", "agentrt.cli", "keys", "create", "--tenant", "acme", "--db",
                              db_url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("art_") and key not in (tmp_path / "restart.db").read_bytes().decode("latin-1")
    headers = {"Authorization": f"Bearer {key}"}

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(db_url, port, log)
    try:
        _wait_up(proc, url, log)
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            assert httpx.get(url + "/v1/chains").status_code == 401
            r = http.post("/v1/chains", json={"tools": [WEATHER_TOOL], "metadata": {"run": "restart"}})
            assert r.status_code == 201, r.text
            cid = r.json()["id"]
            results = []
            for body in ({"messages": [{"role": "user", "content": "Weather in Paris?"}], "assistant_prefix": TOOL_CALL},
                         {"messages": [{"role": "tool", "tool_call_id": "call_x", "name": "get_weather",
                                        "content": '{"temp_c": 18}'}]},
                         {"messages": [{"role": "user", "content": "Umbrella?"}]}):
                r = http.post(f"/v1/chains/{cid}/turns", json={"sampling": SAMPLING, **body})
                assert r.status_code == 200, r.text
                results.append(r.json())
            assert [t["resume_status"] for t in results] == ["created", "resumed", "resumed"]
            before = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
    finally:
        _kill9(proc)

    proc = _serve(db_url, port, log)
    try:
        _wait_up(proc, url, log)
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            after = http.get(f"/v1/chains/{cid}?include_tokens=true").json()
            assert after["num_turns"] == 3 and after["metadata"] == {"run": "restart"}
            assert after["token_ids"] == before["token_ids"] and after["num_tokens"] == before["num_tokens"]
            assert after["regions"] == before["regions"]
            assert [t["resume_status"] for t in after["turns"]] == ["created", "resumed", "resumed"]
            for old, new in zip(before["turns"], after["turns"]):
                assert {k: new[k] for k in ("messages", "message", "usage", "appended_token_ids",
                                            "generated_token_ids")} == \
                       {k: old[k] for k in ("messages", "message", "usage", "appended_token_ids",
                                            "generated_token_ids")}
            assert [k for k in ("tool_result", "user") if k in {r["kind"] for r in after["regions"]}] == \
                ["tool_result", "user"]
            assert after["kv"]["engine_status"] is None  # the new process does not hold the chain's KV

            r = http.post(f"/v1/chains/{cid}/turns", json={"messages": [{"role": "user", "content": "Thanks"}],
                                                           "sampling": SAMPLING})
            assert r.status_code == 200, r.text
            fourth = r.json()
            assert fourth["turn"] == 3 and fourth["resume_status"] == "recomputed"
            assert fourth["usage"]["resumed_tokens"] == 0
            assert fourth["usage"]["prompt_tokens"] == before["num_tokens"] + fourth["usage"]["appended_tokens"]
            final = http.get(f"/v1/chains/{cid}").json()
            assert final["num_turns"] == 4 and final["regions"][: len(before["regions"]) - 1] == \
                before["regions"][:-1]
            assert [c["id"] for c in http.get("/v1/chains").json()["data"]] == [cid]
    finally:
        _kill9(proc)
