"""Liveness and Prometheus metrics (public: no API key needed)."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.datastructures import State
from prometheus_client import CONTENT_TYPE_LATEST


class SystemController(Controller):
    @get("/health", sync_to_thread=False, opt={"public": True})
    def health(self, state: State) -> dict[str, object]:
        snapshot = state.worker.snapshot
        return {"status": "ok", "model": state.model_name, "pages_free": snapshot.pages_free,
                "pages_total": snapshot.num_pages}

    @get("/metrics", sync_to_thread=False, opt={"public": True})
    def metrics(self, state: State) -> Response[bytes]:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
