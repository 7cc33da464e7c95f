"""Anthropic's Messages API: POST /v1/messages (streaming or not) and POST /v1/messages/count_tokens, over implicit
chains (agentrt.anthropic_messages). Every error here is Anthropic's error shape
(agentrt.anthropic_errors.ANTHROPIC_EXCEPTION_HANDLERS).

Anthropic's clients send the key as ``x-api-key`` (``Authorization: Bearer`` is taken too): these handlers
are ``public`` to the app-wide guard, which reads only ``Authorization``, and ``api_key_guard`` runs the same
KeyService check on either header instead, before the body is read. Two different agentrt keys in the two
headers are refused; an agentrt key in one and a placeholder in the other selects the key's tenant (a keyless
server still checks an ``art_`` key, as everywhere else).
"""

from __future__ import annotations

import typing

from litestar import Controller, Request, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.connection import ASGIConnection
from litestar.datastructures import Headers, State
from litestar.di import NamedDependency
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import JSONBody

from agentrt.anthropic_errors import ANTHROPIC_EXCEPTION_HANDLERS
from agentrt.anthropic_messages import chain_headers, messages_service
from agentrt.anthropic_types import CountTokensRequest, CountTokensResponse, Message, MessagesRequest, StreamEvent
from agentrt.auth import KEY_PREFIX, TENANT_SCOPE_KEY
from agentrt.disconnect import unless_disconnected
from agentrt.openapi import API_KEY_HEADER, EVENT_STREAM, REQUEST_EXAMPLES, anthropic_errors
from agentrt.routes.event_stream import EventStream

# public to the app-wide auth guard: api_key_guard authenticates these routes (the OpenAPI document names both
# headers it reads)
PUBLIC = {"public": True, API_KEY_HEADER: "x-api-key"}
# ``event: <type>`` with the event as data, as Anthropic streams (an ``error`` event once a stream has started)
MESSAGE_EVENTS = {t.__struct_config__.tag: (t,) for t in typing.get_args(StreamEvent)}
_EXAMPLE = {"model": "MODEL", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}]}
MESSAGE_EXAMPLES = {"text": _EXAMPLE, "streamed": {**_EXAMPLE, "stream": True}}
_ERRORS = {404: "An unknown model",
           409: "The conversation's chain gained a turn through another route meanwhile: retry",
           429: "A new conversation over the tenant's chain limit (`max_chains_per_tenant`)"}


def _unauthorized(detail: str) -> NotAuthorizedException:
    return NotAuthorizedException(detail=detail, headers={"WWW-Authenticate": 'Bearer realm="agentrt"'})


def authorization(headers: Headers) -> str | None:
    """The ``Authorization`` value KeyService.authenticate checks, from ``x-api-key`` and ``Authorization``."""
    key, header = headers.get("x-api-key"), headers.get("authorization")
    if key is None:
        return header
    key = key.strip()
    if header is None:
        return f"Bearer {key}"
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or token == key:
        return f"Bearer {key}"
    if key.startswith(KEY_PREFIX) and token.startswith(KEY_PREFIX):
        raise _unauthorized("x-api-key and Authorization carry two different API keys: send one")
    return f"Bearer {token if token.startswith(KEY_PREFIX) else key}"


async def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    state = connection.app.state
    value = authorization(connection.headers)
    if value is None and state.config.auth_required:
        raise _unauthorized("an API key is required: send `x-api-key: <key>` (or `Authorization: Bearer <key>`; "
                            "create one with `agentrt keys create --tenant NAME`)")
    connection.scope[TENANT_SCOPE_KEY] = await state.api_keys.authenticate(  # type: ignore[literal-required]
        value, state.config.auth_required)


class AnthropicController(Controller):
    path = "/v1/messages"
    exception_handlers = ANTHROPIC_EXCEPTION_HANDLERS
    guards = [api_key_guard]

    @post("/", status_code=200, opt={**PUBLIC, EVENT_STREAM: MESSAGE_EVENTS, REQUEST_EXAMPLES: MESSAGE_EXAMPLES},
          responses=anthropic_errors(404, 409, 429, 503, descriptions=_ERRORS))
    async def create_message(self, data: JSONBody[MessagesRequest], request: Request, state: State,
                             tenant: NamedDependency[str]) -> Response[Message]:
        service = messages_service(state)
        if data.stream:
            pending = await unless_disconnected(request, service.start(data, tenant))
            return EventStream(service.events(pending), headers=chain_headers(pending.resolved),
                               background=BackgroundTask(pending.close))
        message, resolved = await unless_disconnected(request, service.create(data, tenant))
        return Response(message, headers=chain_headers(resolved))

    @post("/count_tokens", status_code=200, opt=PUBLIC, responses=anthropic_errors(404, descriptions=_ERRORS))
    async def count_tokens(self, data: JSONBody[CountTokensRequest], state: State,
                           tenant: NamedDependency[str]) -> CountTokensResponse:
        return await messages_service(state).count_tokens(data, tenant)
