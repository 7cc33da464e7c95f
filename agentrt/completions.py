"""OpenAI-compatible chat completions: stateless (prefix caching still reuses shared prompt pages), or, with the
``chain_id`` extension, a turn of that chain (agentrt.chain_completions)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from agentrt import chain_completions
from agentrt.chat import ChatRenderer, Message, parse_tool_calls, strip_tool_calls
from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineWorker, RequestStream, prefill_counts
from agentrt.errors import TurnFailed, bad_field
from agentrt.metrics import Metrics
from agentrt.models import LOCAL_TENANT
from agentrt.openai_types import ChainCompletion, ChainCompletionChunk, ChainTurn
from agentrt.openai_types import (AssistantMessageIn, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, Choice,
                                  ChunkChoice, CompletionUsage, Content, Delta, PromptTokensDetails, ToolCallDelta)
from agentrt.openai_types import DeveloperMessage, ToolMessage
from agentrt.openai_types import Message as OpenAIMessage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from sdk.schema import TurnDelta, TurnResult

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from agentrt.turns import PendingTurn


@dataclass(slots=True)
class Completion:
    id: str
    created: int
    model: str
    stream: RequestStream
    include_usage: bool
    turn: PendingTurn | None = None  # with chain_id

    async def abort(self) -> None:
        """For a response that ended before its stream was consumed (client gone)."""
        if self.turn is not None:
            await self.turn.close()
        elif not self.stream.done:
            self.stream.done = True
            self.stream.worker.abort(self.stream.request_id)


class CompletionService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: ChatRenderer,
                 metrics: Metrics, chains: ChainService | None = None):
        self.config = config
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.metrics = metrics
        self.chains = chains

    async def start(self, req: ChatCompletionRequest, tenant: str = LOCAL_TENANT) -> Completion:
        if req.model != self.model_name:
            raise bad_field("model", f"unknown model {req.model!r}; this server serves {self.model_name!r}")
        if req.chain_id is not None:
            return await self._start_chain(req, tenant)
        tools = msgspec.to_builtins(req.tools) if req.tools else None
        prompt = self.renderer.prompt([_template_message(m) for m in req.messages], tools)
        stream = await self.worker.submit(prompt, self._params(req))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, stream, include_usage)

    async def _start_chain(self, req: ChatCompletionRequest, tenant: str) -> Completion:
        assert req.chain_id is not None
        if self.chains is None:
            raise bad_field("chain_id", "this server keeps no chains")
        state = await self.chains.state(req.chain_id, tenant)
        if req.tools is not None and msgspec.to_builtins(req.tools) != state.row.tools:
            raise bad_field("tools", "must equal the chain's tools (or be left out)")
        offset, new = chain_completions.new_messages(req.messages, state)
        p = self._params(req)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
                    "seed": p.seed, "max_tokens": p.max_tokens, "stop": p.stop,
                    "forced_token_ids": p.forced_token_ids}
        turn = await self.chains.start_turn(req.chain_id, chain_completions.turn_request(new, offset, sampling,
                                                                                           req.stream), tenant=tenant)
        if turn.state.num_turns != state.num_turns:  # another request appended a turn meanwhile
            await turn.close()
            raise chain_completions.HistoryDiverged(offset, "the chain gained a turn while this request was read")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, turn.stream,
                          include_usage, turn)

    async def complete(self, c: Completion) -> ChatCompletion:
        if c.turn is not None:
            result = await c.turn.result()
            message, finish = chain_completions.assistant_message(result)
            return ChainCompletion(id=c.id, created=c.created, model=c.model,
                                   usage=chain_completions.usage(result.usage), chain=_chain_turn(result),
                                   choices=[Choice(index=0, message=message, finish_reason=finish)])
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
                  choices: bool = True, chain: ChainTurn | None = None) -> str:
            fields = dict(id=c.id, created=c.created, model=c.model, usage=usage,
                          choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)] if choices else [])
            body = ChatCompletionChunk(**fields) if chain is None else ChainCompletionChunk(**fields, chain=chain)
            return msgspec.json.encode(body).decode()

        yield chunk(Delta(role="assistant", content=""))
        if c.turn is not None:
            result: TurnResult | None = None
            async with aclosing(c.turn.events()) as events:
                async for event in events:
                    if isinstance(event, TurnDelta):
                        if event.text:
                            yield chunk(Delta(content=event.text))
                    else:
                        result = event
            assert result is not None
            message, finish = chain_completions.assistant_message(result)
            calls = [ToolCallDelta(index=i, id=t.id, function=t.function) for i, t in enumerate(message.tool_calls or [])]
            yield chunk(Delta(tool_calls=calls or None), finish, chain=_chain_turn(result))
            if c.include_usage:
                yield chunk(Delta(), usage=chain_completions.usage(result.usage), choices=False)
            yield "[DONE]"
            return
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


def _chain_turn(result: TurnResult) -> ChainTurn:
    return ChainTurn(id=result.chain_id, turn=result.turn, resume_status=result.resume_status)


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
