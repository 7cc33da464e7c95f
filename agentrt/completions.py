"""OpenAI-compatible chat completions: a turn of the tenant's implicit chain holding the longest prefix of the
messages (agentrt.implicit_chains; ``ServerConfig.implicit_chains``), stateless where a chain turn cannot serve
the request (prefix caching still reuses shared prompt pages), or, with the
``chain_id`` extension, a turn of that chain (agentrt.chain_completions).

The request is checked and read in agentrt.completions_input; ``response_format`` and ``tool_choice`` become the
request's grammar (agentrt.structured_spec). The reply's message, log-probabilities and usage are
agentrt.completions_output, a stream's chunks agentrt.completions_chunks. ``tool_choice: "none"`` leaves the text
unparsed (the tools stay in the prompt, as with OpenAI, so a prefix cached with them still serves).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from agentrt import chain_completions
from agentrt.chain_completions import text_of
from agentrt.chat import Message, template_kwargs
from agentrt.completions_chunks import chunks as stream_chunks
from agentrt.completions_input import (check_supported, checked_forced_tokens, enable_thinking, include_usage,
                                       preserve_thinking, sampling_knobs, template_message)
from agentrt.completions_output import (TokenText, chain_message, chain_turn, choice_logprobs, finished_output,
                                        request_usage, text_message)
from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineWorker, RequestStream
from agentrt.errors import ModelNotFound, TooManyChains, bad_field
from agentrt.implicit_chains import implicit_chains_for, turn_create
from agentrt.metrics import Metrics
from agentrt.models import LOCAL_TENANT
from agentrt.openai_types import (AssistantMessageIn, ChainCompletion, ChatCompletion, ChatCompletionRequest, Choice,
                                  DeveloperMessage, SystemMessage, ToolMessage, UserMessage)
from agentrt.reasoning import parser as reasoning_parser
from agentrt.render_pool import RenderPool
from agentrt.structured_spec import structured_spec
from agentrt.tool_syntax import ToolCallReader
from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredSpec
from sdk.schema import Tool

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from agentrt.turns import PendingTurn

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Completion:
    id: str
    created: int
    model: str
    stream: RequestStream
    include_usage: bool
    calls: ToolCallReader | None = None  # None with tool_choice "none": the text is the content, as generated
    logprobs: bool = False
    top_logprobs: int = 0
    turn: PendingTurn | None = None  # with chain_id
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open

    async def abort(self) -> None:
        """For a response that ended before its stream was consumed (client gone)."""
        if self.turn is not None:
            await self.turn.close()
        elif not self.stream.done:
            self.stream.done = True
            self.stream.worker.abort(self.stream.request_id)


class CompletionService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: RenderPool,
                 metrics: Metrics, chains: ChainService | None = None):
        self.config = config
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.metrics = metrics
        self.chains = chains
        self.tokens = TokenText(renderer.renderer.tokenizer)
        self._implied: bool | None = None  # _default_system_implied, once looked up
        self._syntax = renderer.renderer.tool_syntax

    async def start(self, req: ChatCompletionRequest, tenant: str = LOCAL_TENANT) -> Completion:
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        renderer = self.renderer.renderer
        check_supported(req, thinks=renderer.think is not None)
        c = await self._start(req, tenant)
        if c.turn is not None:
            c.thinking = renderer.thinking(c.turn.prompt)
        return c

    async def _start(self, req: ChatCompletionRequest, tenant: str) -> Completion:
        if req.chain_id is not None:
            return await self._start_chain(req, tenant)
        if (conv := self._implicit_conversation(req)) is not None:
            try:
                return await self._start_implicit(req, tenant, *conv)
            except TooManyChains:  # no room for a new implicit chain: the stateless path still serves
                log.info("tenant %s at its chain limit: a stateless completion", tenant)
        tools = msgspec.to_builtins(req.tools) if req.tools else None
        structured, key = structured_spec(req.response_format, req.tool_choice, tools, req.parallel_tool_calls,
                                          self._syntax)
        params = self._params(req, structured)
        with template_kwargs(enable_thinking=enable_thinking(req), preserve_thinking=preserve_thinking(req)):
            prompt = await self.renderer.prompt([template_message(m) for m in req.messages], tools)
        try:
            stream = await self.worker.submit(prompt, params)
        except InvalidSamplingParamsError as exc:  # the engine could not compile the grammar
            if not str(exc).startswith("structured "):
                raise
            raise bad_field(key, str(exc).removeprefix("structured "), "invalid_value") from None
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, stream,
                          include_usage(req), self._reader(req, tools), bool(req.logprobs), req.top_logprobs or 0,
                          thinking=self.renderer.renderer.thinking(prompt))

    async def _start_chain(self, req: ChatCompletionRequest, tenant: str) -> Completion:
        assert req.chain_id is not None
        if self.chains is None:
            raise bad_field("chain_id", "this server keeps no chains")
        if req.logprobs:
            raise bad_field("logprobs", "not available with chain_id (a chain turn carries no log-probabilities): "
                                        "leave out chain_id for a stateless completion", "unsupported_parameter")
        state = await self.chains.state(req.chain_id, tenant)
        if req.tools is not None and msgspec.to_builtins(req.tools) != state.row.tools:
            raise bad_field("tools", "must equal the chain's tools (or be left out)")
        offset, new = chain_completions.new_messages(req.messages, state, self.renderer.reader(state.row.tools))
        structured_spec(req.response_format, req.tool_choice, state.row.tools, req.parallel_tool_calls,
                        self._syntax)  # 400s
        p = self._params(req)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
                    "seed": p.seed, "max_tokens": p.max_tokens, "fit_max_tokens": True, "stop": p.stop,
                    "forced_token_ids": p.forced_token_ids, "response_format": req.response_format,
                    "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls}
        turn_data = chain_completions.turn_request(new, offset, sampling, bool(req.stream))
        turn_data = msgspec.structs.replace(turn_data, hints=req.session_hints)
        with template_kwargs(enable_thinking=enable_thinking(req), preserve_thinking=preserve_thinking(req)):
            turn = await self.chains.start_turn(req.chain_id, turn_data, tenant=tenant)
        if turn.state.num_turns != state.num_turns:  # another request appended a turn meanwhile
            await turn.close()
            raise chain_completions.HistoryDiverged(offset, "the chain gained a turn while this request was read")
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, turn.stream,
                          include_usage(req), self._reader(req, state.row.tools), turn=turn)

    def _reader(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ToolCallReader | None:
        """How the reply's calls are read (None with ``tool_choice: "none"``: the text is the content)."""
        return None if req.tool_choice == "none" else self.renderer.reader(tools)

    def _implicit_conversation(self, req: ChatCompletionRequest
                               ) -> tuple[str | None, list[Message], list[str]] | None:
        """The request as an implicit chain's conversation (system prompt, messages as the chain routes' dicts,
        their request field names), or None where it keeps the stateless path: implicit chains off, no chains,
        ``logprobs`` (a chain turn carries none), tools a chain cannot keep, a system message after the first, a
        first message that is not a user message, a last message that is not a user or tool message, or no system
        message where the chat template's default differs from the server's default system prompt."""
        if not self.config.implicit_chains or self.chains is None or req.logprobs or req.top_logprobs:
            return None
        if req.tools:
            try:  # a chain's tools: fields it does not keep (e.g. ``strict``) keep the stateless path
                msgspec.convert(msgspec.to_builtins(req.tools), list[Tool])
            except msgspec.ValidationError:
                return None
        sent = list(req.messages)
        system: str | None = None
        start = 0
        if sent and isinstance(sent[0], (SystemMessage, DeveloperMessage)):
            system, start = text_of(sent[0].content), 1
        elif not self._default_system_implied():
            return None
        messages: list[Message] = []
        for m in sent[start:]:
            if isinstance(m, UserMessage):
                messages.append({"role": "user", "content": text_of(m.content)})
            elif isinstance(m, ToolMessage):
                messages.append({"role": "tool", "content": text_of(m.content), "tool_call_id": m.tool_call_id,
                                 **({"name": m.name} if m.name else {})})
            elif isinstance(m, AssistantMessageIn):
                message: Message = {"role": "assistant", "content": text_of(m.content)}
                if m.tool_calls:
                    message["tool_calls"] = msgspec.to_builtins(m.tool_calls)
                messages.append(message)
            else:
                return None
        if not messages or messages[0]["role"] != "user" or messages[-1]["role"] == "assistant":
            return None
        return system, messages, [f"messages[{start + i}]" for i in range(len(messages))]

    def _default_system_implied(self) -> bool:
        """Whether the chat template renders a conversation without a system message as one with the server's
        default system prompt (then an implicit chain, which always has a system prompt, sees the same tokens)."""
        if self._implied is None:
            renderer = self.renderer.renderer
            ask: list[Message] = [{"role": "user", "content": "?"}]
            system: Message = {"role": "system", "content": self.config.default_system_prompt}
            tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            try:  # with tools and without: a template may default its system prompt differently
                self._implied = all(renderer.render(ask, tools) == renderer.render([system, *ask], tools)
                                    for tools in (None, tool))
            except Exception:  # a template that refuses either: keep the stateless path
                self._implied = False
        return self._implied

    async def _start_implicit(self, req: ChatCompletionRequest, tenant: str, system: str | None,
                              messages: list[Message], names: list[str]) -> Completion:
        """A turn of the tenant's implicit chain holding the longest prefix of the messages (resumed, forked or
        created: agentrt.implicit_chains), scoped by ``prompt_cache_key``, else ``user`` / ``safety_identifier``."""
        assert self.chains is not None
        tools = msgspec.to_builtins(req.tools) if req.tools else []
        structured_spec(req.response_format, req.tool_choice, tools or None, req.parallel_tool_calls,
                        self._syntax)  # 400s
        p = self._params(req)
        sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
                    "seed": p.seed, "max_tokens": p.max_tokens, "fit_max_tokens": True, "stop": p.stop,
                    "forced_token_ids": p.forced_token_ids, "response_format": req.response_format,
                    "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls}
        session = req.prompt_cache_key or req.user or req.safety_identifier
        implicit = implicit_chains_for(self.chains)
        async with implicit.resolve(tenant, session, system, tools, messages, names) as resolved:
            data = turn_create(messages[resolved.offset:], sampling, stream=bool(req.stream))
            data = msgspec.structs.replace(data, hints=req.session_hints)
            with template_kwargs(enable_thinking=enable_thinking(req), preserve_thinking=preserve_thinking(req)):
                turn = await self.chains.start_turn(resolved.chain_id, data, tenant=tenant)
            if turn.state.num_turns != resolved.state.num_turns:
                from agentrt.anthropic_messages import ChainMoved

                await turn.close()
                raise ChainMoved(detail="the conversation's chain gained a turn through another route meanwhile: "
                                        "retry")
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, turn.stream,
                          include_usage(req), self._reader(req, tools), turn=turn)

    async def complete(self, c: Completion) -> ChatCompletion:
        if c.turn is not None:
            result = await c.turn.result()
            message, finish = chain_message(result, c.calls, reasoning_parser(c.thinking))
            return ChainCompletion(id=c.id, created=c.created, model=c.model,
                                   usage=chain_completions.usage(result.usage), chain=chain_turn(result),
                                   choices=[Choice(index=0, message=message, finish_reason=finish)])
        last = None
        async with aclosing(c.stream.outputs()) as outputs:
            async for out in outputs:
                last = out
        last = finished_output(last, self.metrics)
        message, finish = text_message(last.text, last.finish_reason or "stop", c.calls,
                                       reasoning_parser(c.thinking))
        logprobs = None
        if c.logprobs:
            logprobs = choice_logprobs(self.tokens, c.top_logprobs, last.token_ids, last.logprobs,
                                       last.top_logprobs)
        return ChatCompletion(id=c.id, created=c.created, model=c.model, usage=request_usage(last),
                              choices=[Choice(index=0, message=message, finish_reason=finish, logprobs=logprobs)])

    def chunks(self, c: Completion) -> AsyncGenerator[str, None]:
        """The SSE data of a streamed completion (agentrt.completions_chunks)."""
        return stream_chunks(c, self.tokens, self.metrics)

    def _params(self, req: ChatCompletionRequest, structured: StructuredSpec | None = None) -> SamplingParams:
        # a request that sets none gets the default, within the server's per-turn limit
        # a larger request is lowered to the limit and to what the context holds (agent clients ask for tens of
        # thousands on every request): finish_reason "length" where it runs out
        max_tokens = min(req.max_completion_tokens or req.max_tokens or self.config.default_max_tokens,
                         self.config.max_tokens_per_turn)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        forced = checked_forced_tokens(req.forced_token_ids, max_tokens, self.worker.engine.model_config.vocab_size)
        return SamplingParams(
            **sampling_knobs(req),
            seed=req.seed, max_tokens=max_tokens, stop=stop, forced_token_ids=forced,
            logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0, structured=structured,
            fit_max_tokens=True, skip_special_tokens=not self.renderer.renderer.keeps_special_tokens)
