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
from agentrt.anthropic_types import CountTokensRequest, CountTokensResponse, Message, MessagesRequest
from agentrt.auth import KEY_PREFIX, TENANT_SCOPE_KEY
from agentrt.disconnect import unless_disconnected
from agentrt.routes.event_stream import EventStream

PUBLIC = {"public": True}  # to the app-wide auth guard: api_key_guard authenticates these routes


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
    # the published OpenAPI document describes error bodies per route family (agentrt.openapi): left out until
    # it knows this one's
    include_in_schema = False

    @post("/", status_code=200, opt=PUBLIC)
    async def create_message(self, data: JSONBody[MessagesRequest], request: Request, state: State,
                             tenant: NamedDependency[str]) -> Response[Message]:
        service = messages_service(state)
        if data.stream:
            pending = await unless_disconnected(request, service.start(data, tenant))
            return EventStream(service.events(pending), headers=chain_headers(pending.resolved),
                               background=BackgroundTask(pending.close))
        message, resolved = await unless_disconnected(request, service.create(data, tenant))
        return Response(message, headers=chain_headers(resolved))

    @post("/count_tokens", status_code=200, opt=PUBLIC)
    async def count_tokens(self, data: JSONBody[CountTokensRequest], state: State,
                           tenant: NamedDependency[str]) -> CountTokensResponse:
        return await messages_service(state).count_tokens(data, tenant)
