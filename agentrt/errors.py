"""HTTP errors and the exception handlers that give every error one body shape (sdk.schema.ErrorBody)."""

from __future__ import annotations

import logging
import re
from typing import Any

from jinja2 import TemplateError
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from agentrt.chat import TemplateMismatchError
from agentrt.engine_worker import EngineUnavailable
from engine.chain_index import ChainBusyError, UnknownChainError
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from sdk.schema import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)
_NAMED_FIELD = re.compile(r"(?:unknown|required) field `([^`]+)`")


class ChainNotFound(NotFoundException):
    def __init__(self, chain_id: str):
        super().__init__(detail=f"no chain {chain_id!r}")


class ChainBusy(HTTPException):
    status_code = 409

    def __init__(self, chain_id: str):
        super().__init__(detail=f"chain {chain_id!r} already has a turn in flight")


class TooManyChains(HTTPException):
    status_code = 429

    def __init__(self, tenant: str, limit: int):
        super().__init__(detail=f"tenant {tenant!r} already has {limit} chains, its limit: delete some first")


class TurnFailed(HTTPException):
    status_code = 503


def bad_field(key: str, message: str) -> ValidationException:
    return ValidationException(detail=f"{key}: {message}", extra=[{"message": message, "key": key, "source": "body"}])


def _body(status: int, detail: str, extra: list[ErrorDetail] | None = None,
          headers: dict[str, str] | None = None) -> Response[ErrorBody]:
    return Response(ErrorBody(status_code=status, detail=detail, extra=extra), status_code=status,
                    media_type=MediaType.JSON, headers=headers)


def _details(extra: Any) -> list[ErrorDetail] | None:
    if not isinstance(extra, list):
        return None
    out = []
    for item in extra:
        if not isinstance(item, dict):
            out.append(ErrorDetail(message=str(item)))
            continue
        message, key = str(item.get("message", "")), item.get("key")
        if isinstance(key, str) and key.startswith("data."):
            key = key[len("data."):]
        if m := _NAMED_FIELD.search(message):
            key = m.group(1) if key in (None, "data") else f"{key}.{m.group(1)}"
        if message == "'data'":
            message, key = "a JSON request body is required", None
        out.append(ErrorDetail(message=message, key=key, source=item.get("source")))
    return out


def on_http_error(_: Request, exc: HTTPException) -> Response[ErrorBody]:
    details = _details(exc.extra)
    detail = exc.detail
    if isinstance(exc, ValidationException) and details:
        detail = "; ".join(f"{d.key}: {d.message}" if d.key else d.message for d in details)
    return _body(exc.status_code, detail, details, dict(exc.headers) if exc.headers else None)


def on_invalid_request(_: Request, exc: InvalidRequestError) -> Response[ErrorBody]:
    status = 400 if isinstance(exc, InvalidSamplingParamsError) else 422
    return _body(status, str(exc))


def on_chain_busy(_: Request, exc: ChainBusyError) -> Response[ErrorBody]:
    return _body(409, str(exc))


def on_unknown_chain(_: Request, exc: UnknownChainError) -> Response[ErrorBody]:
    return _body(404, str(exc))


def on_template_error(_: Request, exc: Exception) -> Response[ErrorBody]:
    return _body(422, f"the chat template cannot render these messages: {exc}")


def on_unavailable(_: Request, exc: EngineUnavailable) -> Response[ErrorBody]:
    response = _body(503, str(exc))
    response.headers["Retry-After"] = str(getattr(exc, "retry_after", 5))
    return response


def on_too_deep(_: Request, exc: RecursionError) -> Response[ErrorBody]:
    return _body(400, "malformed request: JSON nested too deeply")


def on_unexpected(_: Request, exc: Exception) -> Response[ErrorBody]:
    log.exception("unhandled error", exc_info=exc)
    return _body(500, f"internal error: {type(exc).__name__}")


EXCEPTION_HANDLERS: Any = {
    HTTPException: on_http_error,
    ChainBusyError: on_chain_busy,
    UnknownChainError: on_unknown_chain,
    InvalidRequestError: on_invalid_request,
    EngineUnavailable: on_unavailable,
    TemplateMismatchError: on_template_error,
    TemplateError: on_template_error,
    RecursionError: on_too_deep,  # msgspec on a deeply nested body ("[[[[...")
    Exception: on_unexpected,
}
