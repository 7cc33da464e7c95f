"""ServerSentEvent that keeps its own content type when the handler's (inferred JSON) one is passed down."""

from __future__ import annotations

from typing import Any

from litestar.response import ServerSentEvent


class EventStream(ServerSentEvent):
    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)
