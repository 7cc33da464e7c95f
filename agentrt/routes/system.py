"""Liveness and Prometheus metrics (public: no API key needed)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.datastructures import State
from prometheus_client import CONTENT_TYPE_LATEST

# Litestar appends "; charset=utf-8" to a text/* media type: the exposition format's own without its charset
METRICS_MEDIA_TYPE = ";".join(p for p in CONTENT_TYPE_LATEST.split(";") if not p.strip().startswith("charset="))


class SystemController(Controller):
    @get("/health", sync_to_thread=False, opt={"public": True})
    def health(self, state: State) -> dict[str, Any]:
        snapshot = state.worker.snapshot
        return {"status": "ok", "model": state.model_name, "pages_free": snapshot.pages_free,
                "pages_total": snapshot.num_pages}

    @get("/metrics", sync_to_thread=False, opt={"public": True}, media_type=METRICS_MEDIA_TYPE)
    def metrics(self, state: State) -> Response[bytes]:
        return Response(state.metrics.render(), media_type=METRICS_MEDIA_TYPE)
