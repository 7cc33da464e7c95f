"""HTTP errors and the exception handlers that give every error one body shape (sdk.schema.ErrorBody), and on the
OpenAI-compatible routes OpenAI's error object instead (``OPENAI_EXCEPTION_HANDLERS``: the same mapping, reshaped)."""

from __future__ import annotations

import logging
import re
from typing import Any

from jinja2 import TemplateError
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from agentrt.chat import TemplateMismatchError
from agentrt.engine_worker import EngineOverloaded, EngineUnavailable
from agentrt.openai_types import ErrorObject, ErrorResponse
from engine.chain_index import ChainBusyError, UnknownChainError
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from sdk.schema import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)
_NAMED_FIELD = re.compile(r"(?:unknown|required) field `([^`]+)`")


class ChainNotFound(NotFoundException):
    def __init__(self, chain_id: str):
        super().__init__(detail=f"no chain {chain_id!r}")


class ModelNotFound(NotFoundException):
    def __init__(self, model: str, served: str):
        super().__init__(detail=f"the model {model!r} does not exist; this server serves {served!r}")


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


def bad_field(key: str, message: str, code: str | None = None) -> ValidationException:
    """A 400 naming the request field ``key``; ``code`` is the OpenAI error code on the OpenAI routes."""
    item = {"message": message, "key": key, "source": "body", **({"code": code} if code else {})}
    return ValidationException(detail=f"{key}: {message}", extra=[item])


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


def on_http_error(request: Request | None, exc: HTTPException) -> Response[ErrorBody | ErrorResponse]:
    """``request`` None: for a WebSocket's error message (always the chain routes' shape). On an OpenAI path
    this handler answers only the router's own errors (405, ...), raised before any route's handlers."""
    if request is not None and _openai_path(request.url.path):
        return _openai_http_error(request, exc)
    if request is not None and request.url.path.rstrip("/").startswith("/v1/messages"):
        from agentrt.anthropic_errors import anthropic_http_error  # it builds on this module's handlers

        return anthropic_http_error(request, exc)
    return _http_error(request, exc)


def _http_error(_: Request, exc: HTTPException) -> Response[ErrorBody]:
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


# --- the OpenAI-compatible routes ------------------------------------------------------------------
def _openai_path(path: str) -> bool:
    path = path.rstrip("/")
    return path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses",
                    "/v1/conversations") or path.startswith(("/v1/models/", "/v1/responses/", "/v1/conversations/"))


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
                 503: "service_unavailable_error"}
_OPENAI_CODES = {401: "invalid_api_key", 405: "method_not_allowed", 409: "conflict", 413: "request_too_large",
                 415: "unsupported_media_type", 429: "rate_limit_exceeded", 500: "internal_error"}


def _msgspec_code(message: str) -> str | None:
    if "unknown field" in message:
        return "unknown_parameter"
    if "missing required field" in message:
        return "missing_required_parameter"
    if message.startswith("Expected `") and ", got `" in message:
        return "invalid_type"
    if message.startswith(("Expected `", "Invalid")):
        return "invalid_value"
    return None


def openai_error(exc: Exception, body: ErrorBody) -> tuple[int, ErrorObject]:
    """The status and OpenAI error object for an error that the chain routes would answer with ``body``.

    What OpenAI answers with 400 is a 400 here too: the engine's refusals (a prompt longer than the model
    takes, more KV than the pool holds) and chat-template failures, which the chain routes give as 422."""
    status, message = body.status_code, body.detail
    param = next((d.key for d in body.extra or [] if d.key), None)
    raw = exc.extra[0] if isinstance(exc, HTTPException) and isinstance(exc.extra, list) and exc.extra else None
    code = raw.get("code") if isinstance(raw, dict) else None
    if param == "data":  # the body as a whole (msgspec's name for it)
        param = None
    if status == 400 and param is not None and code is None:
        code = _msgspec_code(body.extra[0].message if body.extra else "")
        if code == "unknown_parameter":
            message = f"Unrecognized request argument supplied: {param}"
    elif isinstance(exc, InvalidSamplingParamsError):
        param = str(exc).split(" ", 1)[0]
        code = "invalid_value"
    elif isinstance(exc, InvalidRequestError):
        status, param = 400, "messages"
        code = "context_length_exceeded" if "max_model_len" in message or "KV pages" in message else None
    elif isinstance(exc, (TemplateMismatchError, TemplateError)):
        status, param, code = 400, "messages", "invalid_value"
    elif isinstance(exc, ModelNotFound):
        param, code = "model", "model_not_found"
    elif isinstance(exc, (ChainNotFound, UnknownChainError)):
        param, code = "chain_id", "chain_not_found"
    elif isinstance(exc, EngineOverloaded):
        code = "server_is_overloaded"
    error_type = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, ErrorObject(message=message, type=error_type, param=param,
                               code=code or _OPENAI_CODES.get(status))


def _in_shape(handler: Any, shape: Any) -> Any:
    """``handler`` (answering with the chain routes' ErrorBody) answering instead with ``shape(exc, body)``'s
    (status, body): another API's error object, the same status mapping underneath."""
    def reshaped(request: Request | None, exc: Exception) -> Response[Any]:
        response = handler(request, exc)
        status, body = shape(exc, response.content)
        return Response(body, status_code=status, media_type=MediaType.JSON, headers=dict(response.headers) or None)
    return reshaped


def handlers_in_shape(shape: Any) -> tuple[dict[Any, Any], Any]:
    """EXCEPTION_HANDLERS reshaped by ``shape`` (a route family's exception handlers), and the handler for the
    router's own errors (405, ...) on that family's paths."""
    handlers = {cls: _in_shape(_http_error if handler is on_http_error else handler, shape)
                for cls, handler in EXCEPTION_HANDLERS.items()}
    return handlers, _in_shape(_http_error, shape)


def error_body(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The body ``handlers`` answer ``exc`` with (for an error event once a stream has started)."""
    return next(handlers[cls] for cls in type(exc).__mro__ if cls in handlers)(None, exc).content


def _openai_shape(exc: Exception, body: ErrorBody) -> tuple[int, ErrorResponse]:
    status, error = openai_error(exc, body)
    return status, ErrorResponse(error=error)


OPENAI_EXCEPTION_HANDLERS, _openai_http_error = handlers_in_shape(_openai_shape)


def openai_error_body(exc: Exception) -> ErrorResponse:
    """OpenAI's error object for ``exc``, as the OpenAI routes answer it (for an error in a started stream)."""
    return error_body(OPENAI_EXCEPTION_HANDLERS, exc)


class TooManyMethodConfigs(HTTPException):
    """429 on create: the tenant's chains already use its limit of distinct method configurations (each one
    a slot of the engine's ``max_methods``, held while a chain uses it)."""

    status_code = 429

    def __init__(self, tenant: str, limit: int):
        message = (f"tenant {tenant!r} already uses {limit} distinct method configurations, its limit "
                   "(max_method_configs_per_tenant): reuse one of them, or delete the chains using one first")
        super().__init__(detail=f"method_config: {message}",
                         extra=[{"message": message, "key": "method_config", "source": "body"}])

