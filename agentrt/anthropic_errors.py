"""Anthropic's error shape on the Messages routes: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The same mapping as every other route (agentrt.errors.EXCEPTION_HANDLERS: which exception is which status,
which field it names), reshaped as agentrt.errors reshapes it for the OpenAI routes. The message starts with the
field a 400 is about (``messages[1].content[0].type: ...``), so the ``anthropic`` package's exception text names
it. What Anthropic answers with 400 is a 400 here too: the engine's refusals (a prompt longer than the model
takes) and chat-template failures, which the chain routes give as 422.
"""

from __future__ import annotations

from jinja2 import TemplateError

from agentrt.anthropic_types import ErrorObject, ErrorResponse, ErrorType
from agentrt.chat import TemplateMismatchError
from agentrt.errors import error_body, handlers_in_shape
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from sdk.schema import ErrorBody

_TYPES: dict[int, ErrorType] = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                                504: "timeout_error", 529: "overloaded_error"}


def anthropic_error(exc: Exception, body: ErrorBody) -> tuple[int, ErrorObject]:
    """The status and Anthropic error object for an error that the chain routes would answer with ``body``."""
    status, message = body.status_code, body.detail
    refused = isinstance(exc, (InvalidRequestError, TemplateMismatchError, TemplateError)) or status == 422
    if refused and not isinstance(exc, InvalidSamplingParamsError):  # the prompt: too long, or not renderable
        status = 400
        if not message.startswith("messages"):
            message = f"messages: {message}"
    error_type = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, ErrorObject(type=error_type, message=message)


def _anthropic_shape(exc: Exception, body: ErrorBody) -> tuple[int, ErrorResponse]:
    status, error = anthropic_error(exc, body)
    return status, ErrorResponse(error=error)


# the router's own errors (405, ...) on the Messages paths: anthropic_http_error
ANTHROPIC_EXCEPTION_HANDLERS, anthropic_http_error = handlers_in_shape(_anthropic_shape)


def anthropic_error_body(exc: Exception) -> ErrorResponse:
    """The error object for ``exc`` as these routes answer it: the data of an ``error`` event once a stream has
    started."""
    return error_body(ANTHROPIC_EXCEPTION_HANDLERS, exc)
