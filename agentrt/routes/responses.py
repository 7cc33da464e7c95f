"""OpenAI's Responses API: POST /v1/responses (streaming or not), GET / DELETE /v1/responses/{id} and
GET /v1/responses/{id}/input_items, over chains (agentrt.responses). Every error is OpenAI's error object."""

from __future__ import annotations

from typing import Literal

from litestar import Controller, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from msgspec import Struct

from agentrt.disconnect import unless_disconnected
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS
from agentrt.openapi import CREATES, EVENT_STREAM, REQUEST_EXAMPLES, openai_errors
from agentrt.responses import responses_service
from agentrt.responses_types import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest
from agentrt.routes.event_stream import EventStream


# --- the stream's events, for the OpenAPI document (agentrt.responses writes them) ------------------------
class ResponseStreamEvent(Struct, kw_only=True):
    """An event of a streamed response: ``type`` is its name (``response.output_text.delta``, ...); the other
    fields are the event's own (OpenAI's Responses streaming events)."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseStreamEvent, kw_only=True):
    """``response.created``, ``response.in_progress``, and the last: ``response.completed`` or
    ``response.incomplete``."""

    response: ResponseObject


class ResponseErrorEvent(ResponseStreamEvent, kw_only=True):
    """An error once the stream has started (the stream ends there)."""

    type: Literal["error"]
    message: str
    code: str | None
    param: str | None


RESPONSE_EVENTS = {**{name: (ResponseLifecycleEvent,) for name in (
    "response.created", "response.in_progress", "response.completed", "response.incomplete")},
    r"^response\.": (ResponseStreamEvent,), "error": (ResponseErrorEvent,)}
_EXAMPLE = {"model": "MODEL", "input": "Hello!", "max_output_tokens": 4}
RESPONSE_EXAMPLES = {"text": _EXAMPLE, "streamed": {**_EXAMPLE, "stream": True}}
_UNKNOWN = {404: "No stored response with this id for this tenant (another tenant's, deleted, its chain deleted, "
                 "or `store: false`)"}


class ResponsesController(Controller):
    path = "/v1/responses"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS

    @post("/", status_code=200,
          opt={EVENT_STREAM: RESPONSE_EVENTS, CREATES: "response_id", REQUEST_EXAMPLES: RESPONSE_EXAMPLES},
          responses=openai_errors(404, 409, 429, 503, descriptions={
              404: "An unknown model, or an unknown `conversation` (another tenant's, deleted)",
              409: "the conversation's chain (`previous_response_id`'s, `conversation`'s, or the implicit chain holding "
                   "the input) has a turn in flight",
              429: "A new conversation over the tenant's chain limit (`max_chains_per_tenant`)"}))
    async def create_response(self, data: JSONBody[ResponsesRequest], request: Request, state: State,
                              tenant: NamedDependency[str]) -> Response[ResponseObject]:
        service = responses_service(state)
        if data.stream:
            pending = await unless_disconnected(request, service.start(data, tenant))
            return EventStream(service.events(pending), background=BackgroundTask(pending.turn.close))
        return Response(await unless_disconnected(request, service.create(data, tenant)))

    @get("/{response_id:str}", responses=openai_errors(404, descriptions=_UNKNOWN))
    async def retrieve(self, response_id: FromPath[str], state: State,
                       tenant: NamedDependency[str]) -> ResponseObject:
        return await responses_service(state).get(response_id, tenant)

    @delete("/{response_id:str}", status_code=200, responses=openai_errors(404, descriptions=_UNKNOWN))
    async def delete_response(self, response_id: FromPath[str], state: State,
                              tenant: NamedDependency[str]) -> ResponseDeleted:
        await responses_service(state).delete(response_id, tenant)
        return ResponseDeleted(id=response_id)

    @get("/{response_id:str}/input_items", responses=openai_errors(404, descriptions=_UNKNOWN))
    async def input_items(self, response_id: FromPath[str], state: State, tenant: NamedDependency[str],
                          order: FromQuery[str] = "desc", limit: FromQuery[int] = 20,
                          after: FromQuery[str | None] = None) -> InputItemList:
        return await responses_service(state).input_items(response_id, tenant, order, limit, after)
