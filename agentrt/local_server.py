"""Run an app under uvicorn in a background thread on a loopback port (the demo and the tests use it)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class LocalServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 300.0,
                 ws_max_size: int | None = None):
        """``ws_max_size``: the largest WebSocket message uvicorn reads (a bigger one closes the socket with
        1009); default the app's request body limit (``ServerConfig.max_body_size``), as ``agentrt serve``."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        if ws_max_size is None:
            ws_max_size = getattr(app, "request_max_body_size", None) or 16 * 2**20  # uvicorn's default
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", ws_max_size=ws_max_size))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
