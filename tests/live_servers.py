"""Servers the tests talk to over real sockets: `agentrt serve` as a user starts it, or an app under uvicorn in
this process, and the official `openai` client on one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_helpers import ENGINE_OPTIONS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def agentrt_serve(tmp: Path, *args: str) -> Iterator[tuple[str, int]]:
    """`agentrt serve` in a process of its own (the embedded model, a SQLite file under ``tmp``) on a free port:
    (its URL, the port). Stopped with SIGINT, as a user's Ctrl-C."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--device", "cpu",
                             "--db", f"sqlite+aiosqlite:///{tmp / 'server.db'}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "AGENTRT_CACHE": str(tmp)})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"agentrt serve did not start:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    try:
        yield url, port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def app_server(db_url: str, **config: Any):
    """The app under uvicorn in this process (a LocalServer; ``.app`` is the app), on ``db_url``, the test
    engine options and ``config``'s ServerConfig fields (no ``model``: the embedded one)."""
    from agentrt.app import create_app
    from agentrt.config import ServerConfig
    from agentrt.local_server import LocalServer

    app = create_app(ServerConfig(db_url=db_url, engine_options=ENGINE_OPTIONS, **config))
    with LocalServer(app) as server:
        server.app = app
        yield server


def random_model_server(tmp: Path):
    """``app_server`` on the random test model, its database under ``tmp``."""
    from engine.tiny_checkpoint import random_model_dir

    return app_server(f"sqlite+aiosqlite:///{tmp / 'server.db'}", model=random_model_dir())


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# module-scoped fixtures for the OpenAI-route tests (import them by name into a test module)
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with random_model_server(tmp_path_factory.mktemp("db")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
