"""OpenAI's Responses API: POST /v1/responses (streaming or not), GET / DELETE /v1/responses/{id} and
GET /v1/responses/{id}/input_items, over chains (agentrt.responses). Every error is OpenAI's error object."""

from __future__ import annotations

from litestar import Controller, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from agentrt.disconnect import unless_disconnected
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS
from agentrt.responses import responses_service
from agentrt.responses_types import InputItemList, ResponseDeleted, ResponseObject, ResponsesRequest
from agentrt.routes.event_stream import EventStream


class ResponsesController(Controller):
    path = "/v1/responses"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS
    include_in_schema = False  # the OpenAPI document's error bodies per route family: left out for now

    @post("/", status_code=200)
    async def create_response(self, data: JSONBody[ResponsesRequest], request: Request, state: State,
                              tenant: NamedDependency[str]) -> Response[ResponseObject]:
        service = responses_service(state)
        if data.stream:
            pending = await unless_disconnected(request, service.start(data, tenant))
            return EventStream(service.events(pending), background=BackgroundTask(pending.turn.close))
        return Response(await unless_disconnected(request, service.create(data, tenant)))

    @get("/{response_id:str}", sync_to_thread=False)
    def retrieve(self, response_id: FromPath[str], state: State, tenant: NamedDependency[str]) -> ResponseObject:
        return responses_service(state).get(response_id, tenant)

    @delete("/{response_id:str}", status_code=200, sync_to_thread=False)
    def delete_response(self, response_id: FromPath[str], state: State,
                        tenant: NamedDependency[str]) -> ResponseDeleted:
        responses_service(state).delete(response_id, tenant)
        return ResponseDeleted(id=response_id)

    @get("/{response_id:str}/input_items", sync_to_thread=False)
    def input_items(self, response_id: FromPath[str], state: State, tenant: NamedDependency[str],
                    order: FromQuery[str] = "desc", limit: FromQuery[int] = 20,
                    after: FromQuery[str | None] = None) -> InputItemList:
        return responses_service(state).input_items(response_id, tenant, order, limit, after)
