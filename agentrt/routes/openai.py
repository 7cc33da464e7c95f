"""OpenAI-compatible routes: POST /v1/chat/completions (stateless, streaming or not), POST /v1/completions (the
legacy text completions), GET /v1/models and GET /v1/models/{model}. Every error here is OpenAI's error object
(agentrt.errors.OPENAI_EXCEPTION_HANDLERS)."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from agentrt.completions import Completion, CompletionService
from agentrt.disconnect import unless_disconnected
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS, ModelNotFound
from agentrt.openapi import EVENT_STREAM, REQUEST_EXAMPLES, openai_errors
from agentrt.routes.event_stream import EventStream
from agentrt.openai_types import (ChainCompletionChunk, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                  ErrorResponse, ModelCard, ModelList, TextCompletion, TextCompletionRequest)
from agentrt.text_completions import TextRun, text_completions_service

# ``stream: true``: chunks, then ``[DONE]``; an error once the stream has started is one event of OpenAI's error
# object, and the stream ends without ``[DONE]``
COMPLETION_EVENTS = {"message": (ChatCompletionChunk, ChainCompletionChunk, ErrorResponse, "[DONE]")}
TEXT_COMPLETION_EVENTS = {"message": (TextCompletion, ErrorResponse, "[DONE]")}
_TEXT_EXAMPLE = {"model": "MODEL", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
TEXT_COMPLETION_EXAMPLES = {"text": _TEXT_EXAMPLE, "token_ids": {**_TEXT_EXAMPLE, "prompt": [1, 2, 3]},
                            "streamed": {**_TEXT_EXAMPLE, "stream": True, "stream_options": {"include_usage": True}}}


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


class TextCompletionsController(Controller):
    """``POST /v1/completions``: OpenAI's legacy text completions, stateless (agentrt.text_completions)."""

    path = "/v1"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS

    @post("/completions", status_code=200,
          opt={EVENT_STREAM: TEXT_COMPLETION_EVENTS, REQUEST_EXAMPLES: TEXT_COMPLETION_EXAMPLES},
          responses=openai_errors(404, 503, descriptions={404: "An unknown model"}))
    async def text_completions(self, data: JSONBody[TextCompletionRequest], request: Request,
                               state: State) -> TextCompletion | Response:
        service = text_completions_service(state)
        run = await service.start(data)
        if data.stream:
            return EventStream(service.chunks(run), background=BackgroundTask(_abort_text, run))
        return await unless_disconnected(request, service.complete(run))


async def _abort_text(run: TextRun) -> None:
    await run.abort()
