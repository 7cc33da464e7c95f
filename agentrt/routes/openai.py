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
from agentrt.routes.event_stream import EventStream
from agentrt.openai_types import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList


class OpenAIController(Controller):
    path = "/v1"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS

    @post("/chat/completions", status_code=200)
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

    @get("/models/{model_id:str}", sync_to_thread=False)
    def model(self, state: State, model_id: FromPath[str]) -> ModelCard:
        if model_id != state.model_name:
            raise ModelNotFound(model_id, state.model_name)
        return _card(state)


def _card(state: State) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.started_at)


async def _abort(c: Completion) -> None:
    await c.abort()
