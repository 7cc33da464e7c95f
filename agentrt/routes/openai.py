"""OpenAI-compatible routes: POST /v1/chat/completions (stateless, streaming or not), GET /v1/models and
GET /v1/models/{model}. Every error here is OpenAI's error object (agentrt.errors.OPENAI_EXCEPTION_HANDLERS)."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from agentrt.completions import Completion, CompletionService
from agentrt.disconnect import unless_disconnected
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS, ModelNotFound
from agentrt.openapi import EVENT_STREAM, openai_errors
from agentrt.routes.event_stream import EventStream
from agentrt.openai_types import (ChainCompletionChunk, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                  ErrorResponse, ModelCard, ModelList)

# ``stream: true``: chunks, then ``[DONE]``; an error once the stream has started is one event of OpenAI's error
# object, and the stream ends without ``[DONE]``
COMPLETION_EVENTS = {"message": (ChatCompletionChunk, ChainCompletionChunk, ErrorResponse, "[DONE]")}


class OpenAIController(Controller):
    path = "/v1"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS

    @post("/chat/completions", status_code=200, opt={EVENT_STREAM: COMPLETION_EVENTS},
          responses=openai_errors(404, 409, 503, descriptions={
              404: "An unknown model; with `chain_id`, an unknown chain or another tenant's",
              409: "With `chain_id`: a history that diverges from the chain's, or a chain with a turn in flight"}))
    async def chat_completions(self, data: JSONBody[ChatCompletionRequest], request: Request,
                               completions: NamedDependency[CompletionService],
                               tenant: NamedDependency[str]) -> ChatCompletion | Response:
        c = await completions.start(data, tenant)
        if data.stream:
            return EventStream(completions.chunks(c), background=BackgroundTask(_abort, c))
        return await unless_disconnected(request, completions.complete(c))

    @get("/models", sync_to_thread=False)
    def models(self, state: State) -> ModelList:
        return ModelList(data=[_card(state)])

    @get("/models/{model_id:str}", sync_to_thread=False,
         responses=openai_errors(404, descriptions={404: "Not the served model"}))
    def model(self, state: State, model_id: FromPath[str]) -> ModelCard:
        if model_id != state.model_name:
            raise ModelNotFound(model_id, state.model_name)
        return _card(state)


def _card(state: State) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.started_at)


async def _abort(c: Completion) -> None:
    await c.abort()
