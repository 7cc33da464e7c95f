"""Pieces shared by the sync and async clients: request bodies, response decoding, error mapping, retry delays."""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import httpx
import msgspec

from sdk.errors import AgentrtConnectionError, AgentrtError, error_for
from sdk.schema import (ChainRead, ErrorBody, ErrorDetail, PruneEvent, Sampling, ToolCall, ToolResultMessage,
                        TurnDelta, TurnResult, UserMessage)

T = TypeVar("T")
DEFAULT_TIMEOUT = 120.0

MessageLike = str | UserMessage | ToolResultMessage | Mapping[str, Any]


def tool_result(call: ToolCall | str, content: Any, name: str | None = None) -> ToolResultMessage:
    """A tool-result message answering ``call`` (a ToolCall, or its id); non-string content is sent as JSON."""
    if isinstance(call, ToolCall):
        call_id, name = call.id, name or call.function.name
    else:
        call_id = call
    text = content if isinstance(content, str) else json.dumps(content)
    return ToolResultMessage(content=text, tool_call_id=call_id, name=name)


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj) if isinstance(obj, msgspec.Struct) else obj


def _message(m: Any) -> Any:
    if isinstance(m, str):
        return {"role": "user", "content": m}
    if isinstance(m, tuple):
        return _builtins(tool_result(*m))
    return _builtins(m)


def turn_body(messages: MessageLike | Iterable[MessageLike] | None, tool_results: Iterable[Any] | None,
              assistant_prefix: str | None, sampling: Sampling | Mapping[str, Any] | None,
              overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``POST /v1/chains/{id}/turns`` body. Messages: text (a user message), a UserMessage /
    ToolResultMessage, a dict, or a list of them; tool results: ToolResultMessages, dicts or
    ``(call or call_id, content)`` pairs, appended after the messages. Values are checked by the server."""
    if messages is None:
        items: list[Any] = []
    elif isinstance(messages, (str, Mapping, msgspec.Struct)):
        items = [messages]
    else:
        items = list(messages)
    items += list(tool_results or [])
    body: dict[str, Any] = {"messages": [_message(m) for m in items]}
    if assistant_prefix is not None:
        body["assistant_prefix"] = assistant_prefix
    merged = dict(_builtins(sampling) or {})
    merged.update(overrides)
    if merged:
        body["sampling"] = merged
    return body


def drop_none(**kw: Any) -> dict[str, Any]:
    return {k: _builtins(v) for k, v in kw.items() if v is not None}


def create_body(**kw: Any) -> dict[str, Any]:
    body = drop_none(**kw)
    if "tools" in body:
        body["tools"] = [_builtins(t) for t in body["tools"]]
    return body


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def error_from_response(response: httpx.Response) -> AgentrtError:
    retry_after = _retry_after(response.headers)
    try:
        body = msgspec.json.decode(response.content, type=ErrorBody)
        return error_for(response.status_code, body.detail, body.extra, body, retry_after)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = response.text or response.reason_phrase
        return error_for(response.status_code, text, None, text, retry_after)


def error_from_message(message: Mapping[str, Any]) -> AgentrtError:
    """An ``{"type": "error", ...}`` WebSocket message as the typed error."""
    extra = msgspec.convert(message.get("extra") or [], list[ErrorDetail])
    return error_for(int(message.get("status_code", 500)), str(message.get("detail", "")), extra, dict(message))


def connection_error(base_url: str, exc: BaseException) -> AgentrtConnectionError:
    """The SDK's error for a transport failure (httpx.TransportError, OSError, TimeoutError) on ``base_url``."""
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
        reason += " (is the server running? `agentrt serve` starts one)"
    return AgentrtConnectionError(base_url, f"cannot reach the agentrt server at {base_url}: {reason}")


def closed_error(base_url: str, exc: Any) -> AgentrtConnectionError:
    """The server closed the turn's WebSocket (a websockets ConnectionClosed) before the turn's result."""
    rcvd = getattr(exc, "rcvd", None)
    how = f"code {rcvd.code}" + (f": {rcvd.reason}" if rcvd.reason else "") if rcvd is not None else "no close frame"
    return AgentrtConnectionError(base_url, f"the agentrt server at {base_url} closed the WebSocket before the "
                                            f"turn's result ({how})")


def retry_delay(attempt: int, response: httpx.Response, base: float, cap: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): the server's Retry-After when given, else
    exponential backoff ``base * 2**attempt``; both capped at ``cap``."""
    after = _retry_after(response.headers)
    return min(cap, after if after is not None else base * (2 ** attempt))


def decode(response: httpx.Response, type_: type[T]) -> T:
    return msgspec.json.decode(response.content, type=type_)


def ws_url(base_url: str, chain_id: str) -> str:
    url = httpx.URL(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(url.scheme, url.scheme)
    path = url.path.rstrip("/") + f"/v1/chains/{chain_id}/ws"
    return str(url.copy_with(scheme=scheme, path=path))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class StreamDecoder:
    """Turns the WebSocket's JSON messages into TurnDelta objects, then one TurnResult (``done``)."""

    def __init__(self) -> None:
        self.result: TurnResult | None = None
        self.prunes_left = 0

    def feed(self, raw: str | bytes) -> TurnDelta | TurnResult | PruneEvent:
        message = msgspec.json.decode(raw)
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "delta":
            return msgspec.convert(message, TurnDelta)
        if kind == "turn_end":
            self.result = msgspec.convert(message, TurnResult)
            self.prunes_left = len(self.result.pruned)
            return self.result
        if kind == "prune":
            self.prunes_left -= 1
            return msgspec.convert(message, PruneEvent)
        if kind == "error":
            raise error_from_message(message)
        raise AgentrtError(f"unexpected WebSocket message: {message!r}")

    @property
    def done(self) -> bool:
        return self.result is not None and self.prunes_left <= 0


__all__ = ["ChainRead", "DEFAULT_TIMEOUT", "StreamDecoder", "tool_result"]
