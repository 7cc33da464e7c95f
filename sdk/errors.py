"""Typed errors of the agentrt SDK, built from the server's one error body (``sdk.schema.ErrorBody``)."""

from __future__ import annotations

from typing import Any

from sdk.schema import ErrorDetail


class AgentrtError(Exception):
    """Base of every SDK error. ``status_code`` is None for errors raised before a response (transport, protocol)."""

    def __init__(self, detail: str, status_code: int | None = None, extra: list[ErrorDetail] | None = None,
                 body: Any = None):
        super().__init__(f"{status_code}: {detail}" if status_code is not None else detail)
        self.detail = detail
        self.status_code = status_code
        self.extra: list[ErrorDetail] = list(extra or [])
        self.body = body

    @property
    def fields(self) -> list[str]:
        """The fields the server named (``extra[].key``), in order."""
        return [d.key for d in self.extra if d.key]

    @property
    def field(self) -> str | None:
        """The first field the server named, e.g. ``sampling.max_tokens`` or ``intervals[0]``."""
        return self.fields[0] if self.fields else None


class AuthError(AgentrtError):
    """401: missing or wrong API key."""


class NotFound(AgentrtError):
    """404: unknown chain (or route)."""


class Conflict(AgentrtError):
    """409: the chain has a turn in flight."""


class Invalid(AgentrtError):
    """400 (malformed or out-of-range field; ``field`` names it) or 422 (a request the engine refuses)."""


class AgentrtConnectionError(AgentrtError):
    """No response: the server at ``url`` could not be reached (nothing listens there, DNS, a timeout, the
    connection dropped) or closed the WebSocket mid-turn. ``status_code`` is None; ``__cause__`` is the
    transport's exception."""

    def __init__(self, url: str, detail: str):
        super().__init__(detail)
        self.url = url


class Overloaded(AgentrtError):
    """503: the server or engine cannot take the request now; retried with backoff up to ``max_retries``."""

    def __init__(self, *args: Any, retry_after: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.retry_after = retry_after


_BY_STATUS: dict[int, type[AgentrtError]] = {400: Invalid, 401: AuthError, 404: NotFound, 409: Conflict,
                                             422: Invalid, 503: Overloaded}


def error_for(status: int, detail: str, extra: list[ErrorDetail] | None = None, body: Any = None,
              retry_after: float | None = None) -> AgentrtError:
    cls = _BY_STATUS.get(status, AgentrtError)
    if cls is Overloaded:
        return Overloaded(detail, status, extra, body, retry_after=retry_after)
    return cls(detail, status, extra, body)
