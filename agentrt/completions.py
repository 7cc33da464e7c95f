"""Stateless OpenAI-compatible chat completions (prefix caching still reuses shared prompt pages)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import msgspec

from agentrt.chat import ChatRenderer, Message, parse_tool_calls, strip_tool_calls
from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineWorker, RequestStream, prefill_counts
from agentrt.errors import TurnFailed, bad_field
from agentrt.metrics import Metrics
from agentrt.openai_types import (AssistantMessageIn, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, Choice,
                                  ChunkChoice, CompletionUsage, Content, Delta, PromptTokensDetails, ToolCallDelta)
from agentrt.openai_types import DeveloperMessage, ToolMessage
from agentrt.openai_types import Message as OpenAIMessage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    id: str
    created: int
    model: str
    stream: RequestStream
    include_usage: bool


class CompletionService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: ChatRenderer,
                 metrics: Metrics):
        self.config = config
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.metrics = metrics

    async def start(self, req: ChatCompletionRequest) -> Completion:
        if req.model != self.model_name:
            raise bad_field("model", f"unknown model {req.model!r}; this server serves {self.model_name!r}")
        tools = msgspec.to_builtins(req.tools) if req.tools else None
        prompt = self.renderer.prompt([_template_message(m) for m in req.messages], tools)
        stream = await self.worker.submit(prompt, self._params(req))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, stream, include_usage)

    async def complete(self, c: Completion) -> ChatCompletion:
        last = None
        async with aclosing(c.stream.outputs()) as outputs:
            async for out in outputs:
                last = out
        last = self._finished(last)
        message, finish = _message(last)
        return ChatCompletion(id=c.id, created=c.created, model=c.model, usage=self._usage(last),
                              choices=[Choice(index=0, message=message, finish_reason=finish)])

    async def chunks(self, c: Completion) -> AsyncGenerator[str, None]:
        def chunk(delta: Delta, finish: str | None = None, usage: CompletionUsage | None = None,
                  choices: bool = True) -> str:
            body = ChatCompletionChunk(id=c.id, created=c.created, model=c.model, usage=usage,
                                       choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)] if choices else [])
            return msgspec.json.encode(body).decode()

        yield chunk(Delta(role="assistant", content=""))
        last = None
        async with aclosing(c.stream.outputs()) as outputs:
            async for out in outputs:
                last = out
                if out.new_text:
                    yield chunk(Delta(content=out.new_text))
        last = self._finished(last)
        message, finish = _message(last)
        calls = [ToolCallDelta(index=i, id=t.id, function=t.function) for i, t in enumerate(message.tool_calls or [])]
        yield chunk(Delta(tool_calls=calls or None), finish)
        if c.include_usage:
            yield chunk(Delta(), usage=self._usage(last), choices=False)
        yield "[DONE]"

    def _params(self, req: ChatCompletionRequest) -> SamplingParams:
        max_tokens = req.max_completion_tokens or req.max_tokens or self.config.default_max_tokens
        if max_tokens > self.config.max_tokens_per_turn:
            key = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise bad_field(key, f"must be <= {self.config.max_tokens_per_turn}")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        forced = list(req.forced_token_ids or [])
        vocab = self.worker.engine.model_config.vocab_size
        if len(forced) > max_tokens:
            raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_tokens ({max_tokens})")
        if any(t >= vocab for t in forced):
            raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed, max_tokens=max_tokens, stop=stop, forced_token_ids=forced)

    def _finished(self, last: RequestOutput | None) -> RequestOutput:
        if last is None or last.finish_reason == "abort":
            raise TurnFailed(detail="the request was aborted before it finished")
        prefilled, resumed, cached = prefill_counts(last)
        self.metrics.record_request(prefilled, resumed, cached, len(last.token_ids))
        return last

    @staticmethod
    def _usage(out: RequestOutput) -> CompletionUsage:
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _text(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _template_message(m: OpenAIMessage) -> Message:
    role = "system" if isinstance(m, DeveloperMessage) else str(m.__struct_config__.tag)
    out: Message = {"role": role, "content": _text(m.content)}
    if isinstance(m, AssistantMessageIn) and m.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(m.tool_calls)
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
    return out


def _message(out: RequestOutput) -> tuple[ChatMessage, str]:
    finish = out.finish_reason or "stop"
    calls = parse_tool_calls(out.text)
    if calls:
        text = strip_tool_calls(out.text)
        return ChatMessage(content=text or None, tool_calls=calls),  "tool_calls" if finish == "stop" else finish
    return ChatMessage(content=out.text), finish
