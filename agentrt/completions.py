"""OpenAI-compatible chat completions: a turn of the tenant's implicit chain holding the longest prefix of the
messages (agentrt.implicit_chains; ``ServerConfig.implicit_chains``), stateless where a chain turn cannot serve
the request (prefix caching still reuses shared prompt pages), or, with the
``chain_id`` extension, a turn of that chain (agentrt.chain_completions).

A response's message is the generated text split by the tool-call rules of agentrt.chat: ``content`` is
``strip_tool_calls(text)`` (None when nothing is left), ``tool_calls`` is ``parse_tool_calls(text)``, and a
stop with calls finishes as ``tool_calls``. A stream gives the same message: its text goes through a
ToolCallStream, so markup never arrives as content, and each call arrives as one ``tool_calls`` delta.
``tool_choice: "none"`` leaves the text unparsed: the content is the text as generated, markup and all (the
tools stay in the prompt, as with OpenAI, so a prefix cached with them still serves).

A model that thinks (agentrt.reasoning) has its think block split off first: ``message.reasoning_content`` (and
``delta.reasoning_content`` chunks) carries it, the content and the calls are read from what follows it.
``reasoning_effort`` ("none": off, any other level: on) and ``chat_template_kwargs.enable_thinking`` (which wins)
become the chat template's ``enable_thinking``.

``response_format`` (``json_object``, ``json_schema``) and ``tool_choice`` (``"required"``, a named function,
``"auto"`` over ``strict`` tools) become the request's grammar (``structured_spec``; docs/structured-outputs.md):
the engine masks every token that would leave it, so the JSON parses and the tool calls parse and follow their
tools' parameters.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from agentrt import chain_completions
from agentrt.chain_completions import text_of
from agentrt.chat import Message, calls_in, template_kwargs, without_calls
from agentrt.render_pool import RenderPool
from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineWorker, RequestStream, prefill_counts
from agentrt.errors import ModelNotFound, TooManyChains, TurnFailed, bad_field, openai_error_body
from agentrt.implicit_chains import implicit_chains_for, turn_create
from agentrt.metrics import Metrics
from agentrt.models import LOCAL_TENANT
from agentrt.openai_types import (AssistantMessageIn, ChainCompletion, ChainCompletionChunk, ChainTurn, ChatCompletion,
                                  ChatCompletionChunk, ChatCompletionRequest, ChatMessage, Choice, ChoiceLogprobs,
                                  ChunkChoice, CompletionUsage, Delta, DeveloperMessage, FunctionMessage,
                                  PromptTokensDetails, RefusalPart, SystemMessage, TextPart, TokenLogprob, ToolCallDelta,
                                  ToolMessage, TopLogprob, UserMessage)
from agentrt.openai_types import Message as OpenAIMessage
from agentrt.reasoning import ReasoningParser, parser as reasoning_parser
from agentrt.tool_call_stream import ToolCallStream
from engine.errors import InvalidSamplingParamsError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredSpec, schema_error
from sdk.schema import (JsonObjectFormat, NamedToolChoice, ResponseFormat, TextFormat, Tool, ToolCall, TurnDelta,
                        TurnResult)

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from agentrt.turns import PendingTurn

log = logging.getLogger(__name__)
_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability zero (JSON has no -inf)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's; "none" is off


@dataclass(slots=True)
class Completion:
    id: str
    created: int
    model: str
    stream: RequestStream
    include_usage: bool
    parse_calls: bool = True  # False with tool_choice "none": the text is the content, as generated
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
        structured, key = structured_spec(req.response_format, req.tool_choice, tools, req.parallel_tool_calls)
        params = self._params(req, structured)
        with template_kwargs(enable_thinking=enable_thinking(req), preserve_thinking=preserve_thinking(req)):
            prompt = await self.renderer.prompt([_template_message(m) for m in req.messages], tools)
        try:
            stream = await self.worker.submit(prompt, params)
        except InvalidSamplingParamsError as exc:  # the engine could not compile the grammar
            if not str(exc).startswith("structured "):
                raise
            raise bad_field(key, str(exc).removeprefix("structured "), "invalid_value") from None
        return Completion(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, stream,
                          _include_usage(req), req.tool_choice != "none", bool(req.logprobs), req.top_logprobs or 0,
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
        offset, new = chain_completions.new_messages(req.messages, state)
        structured_spec(req.response_format, req.tool_choice, state.row.tools, req.parallel_tool_calls)  # 400s
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
                          _include_usage(req), req.tool_choice != "none", turn=turn)

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
        structured_spec(req.response_format, req.tool_choice, tools or None, req.parallel_tool_calls)  # 400s
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
                          _include_usage(req), req.tool_choice != "none", turn=turn)

    async def complete(self, c: Completion) -> ChatCompletion:
        if c.turn is not None:
            result = await c.turn.result()
            message, finish = _chain_message(result, c.parse_calls, reasoning_parser(c.thinking))
            return ChainCompletion(id=c.id, created=c.created, model=c.model,
                                   usage=chain_completions.usage(result.usage), chain=_chain_turn(result),
                                   choices=[Choice(index=0, message=message, finish_reason=finish)])
        last = None
        async with aclosing(c.stream.outputs()) as outputs:
            async for out in outputs:
                last = out
        last = self._finished(last)
        message, finish = _message(last.text, last.finish_reason or "stop", c.parse_calls,
                                   reasoning_parser(c.thinking))
        logprobs = None
        if c.logprobs:
            logprobs = self._logprobs(c, last.token_ids, last.logprobs, last.top_logprobs)
        return ChatCompletion(id=c.id, created=c.created, model=c.model, usage=self._usage(last),
                              choices=[Choice(index=0, message=message, finish_reason=finish, logprobs=logprobs)])

    async def chunks(self, c: Completion) -> AsyncGenerator[str, None]:
        """The SSE data of a streamed completion: a role chunk, content and tool-call chunks, a chunk with the
        finish reason, the usage chunk (with ``include_usage``), ``[DONE]``. An error after the response
        started arrives as an event whose data is OpenAI's error object (what the OpenAI clients raise)."""
        def chunk(delta: Delta, finish: str | None = None, usage: CompletionUsage | None = None,
                  choices: bool = True, chain: ChainTurn | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
            fields = dict(id=c.id, created=c.created, model=c.model, usage=usage,
                          choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=logprobs)]
                          if choices else [])
            body = ChatCompletionChunk(**fields) if chain is None else ChainCompletionChunk(**fields, chain=chain)
            return msgspec.json.encode(body).decode()

        def calls_delta(calls: list[ToolCall], first: int) -> Delta:
            return Delta(tool_calls=[ToolCallDelta(index=first + i, id=t.id, function=t.function)
                                     for i, t in enumerate(calls)])

        parser = ToolCallStream() if c.parse_calls else None
        thinking = reasoning_parser(c.thinking)

        def split(text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
            """(reasoning, content, calls) that a piece of the text (or its end) releases."""
            reasoning, rest = "", text
            if thinking is not None:
                reasoning, rest = thinking.finish() if final else thinking.feed(text)
            if parser is None:
                return reasoning, rest, []
            content, calls = parser.feed(rest) if rest else ("", [])
            if final:
                more, more_calls = parser.finish()
                content, calls = content + more, calls + more_calls
            return reasoning, content, calls

        try:
            yield chunk(Delta(role="assistant"))
            if c.turn is not None:
                result: TurnResult | None = None
                async with aclosing(c.turn.events()) as events:
                    async for event in events:
                        if isinstance(event, TurnDelta):
                            reasoning, text, _ = split(event.text)
                            if reasoning or text:
                                yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
                        else:
                            result = event
                assert result is not None
                reasoning, text, _ = split("", final=True)
                if reasoning or text:
                    yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
                message, finish = _chain_message(result, c.parse_calls, reasoning_parser(c.thinking))
                if message.tool_calls:  # the chain's ids: its tool results are matched to its calls by id
                    yield chunk(calls_delta(message.tool_calls, 0))
                yield chunk(Delta(), finish, chain=_chain_turn(result))
                if c.include_usage:
                    yield chunk(Delta(), usage=chain_completions.usage(result.usage), choices=False)
                yield "[DONE]"
                return
            last = None
            sent_calls = 0
            async with aclosing(c.stream.outputs()) as outputs:
                async for out in outputs:
                    last = out
                    reasoning, text, calls = split(out.new_text)
                    logprobs = None
                    if c.logprobs and out.new_token_ids:
                        n = len(out.new_token_ids)
                        top = out.top_logprobs
                        logprobs = self._logprobs(c, out.new_token_ids, (out.logprobs or [])[-n:],
                                                  top[-n:] if top else None)
                    if reasoning or text or logprobs:
                        yield chunk(Delta(reasoning_content=reasoning or None, content=text or None),
                                    logprobs=logprobs)
                    if calls:
                        yield chunk(calls_delta(calls, sent_calls))
                        sent_calls += len(calls)
            last = self._finished(last)
            reasoning, text, calls = split("", final=True)
            if reasoning or text:
                yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
            if calls:
                yield chunk(calls_delta(calls, sent_calls))
                sent_calls += len(calls)
            finish = last.finish_reason or "stop"
            yield chunk(Delta(), "tool_calls" if sent_calls and finish == "stop" else finish)
            if c.include_usage:
                yield chunk(Delta(), usage=self._usage(last), choices=False)
            yield "[DONE]"
        except Exception as exc:  # the status line is sent: the error goes into the stream
            log.info("stream %s failed: %r", c.id, exc)
            yield msgspec.json.encode(openai_error_body(exc)).decode()

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
            fit_max_tokens=True)

    def _logprobs(self, c: Completion, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> ChoiceLogprobs:
        entries = []
        for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs or [])):
            text, raw = self.tokens(token_id)
            alternatives = []
            for alt_id, alt_logprob in (top[k][:c.top_logprobs] if top and c.top_logprobs else []):
                alt_text, alt_raw = self.tokens(alt_id)
                alternatives.append(TopLogprob(token=alt_text, logprob=_finite(alt_logprob), bytes=alt_raw))
            entries.append(TokenLogprob(token=text, logprob=_finite(logprob), bytes=raw, top_logprobs=alternatives))
        return ChoiceLogprobs(content=entries)

    def _finished(self, last: RequestOutput | None) -> RequestOutput:
        return finished_output(last, self.metrics)

    @staticmethod
    def _usage(out: RequestOutput) -> CompletionUsage:
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


class TokenText:
    """A token's text (the tokenizer's decoding of the id alone) and its bytes, for ``logprobs``. For a
    byte-level BPE the bytes are the token's own (a token may hold part of a UTF-8 character, whose text
    alone is U+FFFD); otherwise the UTF-8 of its text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, list(self._bytes(token_id, text)))
        return hit

    def _bytes(self, token_id: int, text: str) -> bytes:
        if self._byte_level and token_id not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in _BYTE_OF_CHAR for ch in piece):
                return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return text.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def finished_output(last: RequestOutput | None, metrics) -> RequestOutput:
    """A stateless request's last output, its prefill counts recorded; TurnFailed if it was aborted."""
    if last is None or last.finish_reason == "abort":
        raise TurnFailed(detail="the request was aborted before it finished")
    prefilled, resumed, cached = prefill_counts(last)
    metrics.record_request(prefilled, resumed, cached, len(last.token_ids))
    return last


def sampling_knobs(req: Any) -> dict[str, Any]:
    """temperature, top_p, top_k and min_p of an OpenAI request (chat or text completion) for the engine:
    ``top_p`` 0 means greedy (a nucleus of one token), since the engine takes top_p in (0, 1]."""
    greedy = req.top_p == 0
    return dict(temperature=0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None or greedy else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p)


def checked_forced_tokens(forced: list[int] | None, max_tokens: int, vocab: int) -> list[int]:
    """The ``forced_token_ids`` extension, checked against the turn's token budget and the vocabulary."""
    forced = list(forced or [])
    if len(forced) > max_tokens:
        raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_tokens ({max_tokens})")
    if any(t >= vocab for t in forced):
        raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
    return forced


def check_supported(req: ChatCompletionRequest, thinks: bool = False) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do as OpenAI would (docs/server.md has
    the table of every request field). ``thinks``: the model thinks (agentrt.reasoning), so
    ``reasoning_effort`` may turn its thinking on or off."""
    def refuse(key: str, why: str, code: str = "unsupported_parameter") -> None:
        raise bad_field(key, why, code)

    if req.functions is not None:
        refuse("functions", "deprecated by OpenAI and not supported: declare functions as `tools` "
                            '([{"type": "function", "function": {...}}])')
    if req.function_call is not None:
        refuse("function_call", "deprecated by OpenAI and not supported: use `tool_choice` with `tools`")
    if req.n is not None and req.n != 1:
        refuse("n", "only one choice per request is generated here (n = 1)", "unsupported_value")
    for key in ("frequency_penalty", "presence_penalty"):
        if getattr(req, key):
            refuse(key, "must be 0 or left out: the engine applies no penalties", "unsupported_value")
    if req.logit_bias:
        refuse("logit_bias", "must be empty or left out: the engine applies no logit bias", "unsupported_value")
    if req.modalities is not None and req.modalities != ["text"]:
        refuse("modalities", 'only ["text"]: this model generates text', "unsupported_value")
    if req.audio is not None:
        refuse("audio", "this model generates text only")
    # a model that does not think takes any level with no effect (agent clients send their configured effort)
    if req.reasoning_effort not in (None, *REASONING_EFFORTS):
        refuse("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)} (\"none\": no thinking; any "
                                   "other level turns thinking on)", "invalid_value")
    if req.web_search_options is not None:
        refuse("web_search_options", "this server does not search the web")
    if req.moderation is not None:
        refuse("moderation", "this server runs no moderation")
    if req.top_logprobs and not req.logprobs:
        refuse("top_logprobs", "requires `logprobs: true`", "invalid_value")
    for i, m in enumerate(req.messages):
        if isinstance(m, FunctionMessage):
            refuse(f"messages[{i}].role", "role 'function' is deprecated by OpenAI and not supported: send a "
                                          "tool's result as a 'tool' message with its tool_call_id", "invalid_value")
        if isinstance(m, AssistantMessageIn):
            if m.function_call is not None:
                refuse(f"messages[{i}].function_call", "deprecated by OpenAI and not supported: use tool_calls")
            if m.audio is not None:
                refuse(f"messages[{i}].audio", "this model takes text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if not isinstance(part, (TextPart, RefusalPart)) or (isinstance(part, RefusalPart)
                                                                      and not isinstance(m, AssistantMessageIn)):
                    refuse(f"messages[{i}].content[{j}].type",
                           f"this model takes text only, not {part.__struct_config__.tag!r} parts", "invalid_value")


def structured_spec(response_format: Any, tool_choice: Any, tools: list[dict[str, Any]] | None,
                    parallel_tool_calls: bool | None = None, prefix: str = "",
                    tools_key: str | None = None) -> tuple[StructuredSpec | None, str]:
    """The grammar a reply must match (None: free text) and the request field it comes from, for OpenAI's
    ``response_format`` and ``tool_choice`` over ``tools`` (OpenAI's tool dicts); a 400 naming the field when one
    is malformed or cannot be followed. ``prefix``: the fields' path (``sampling.`` in a chain turn);
    ``tools_key``: the field named for a tool whose parameters cannot be followed (default
    ``tools[i].function.parameters``).

    ``"required"``: one or more calls of the tools and nothing else (one with ``parallel_tool_calls`` false), each
    call's arguments following its tool's parameters; a named function: one call of it. ``"auto"`` (or none
    given) with tools: where some tool is ``strict``, free text in which every call that starts is a whole call
    of a tool (a strict tool's arguments follow its parameters, another's are any JSON object); with a JSON
    ``response_format`` too, the reply is that JSON or calls. ``"none"`` or no tools: ``response_format`` alone.
    """
    rf_key, tc_key = prefix + "response_format", prefix + "tool_choice"
    content = _content_schema(response_format, rf_key)
    mode, name = _tool_choice(tool_choice, tc_key)
    functions = [(i, t["function"]) for i, t in enumerate(tools or [])]
    one = parallel_tool_calls is False
    if mode in ("required", "function"):
        if not functions:
            raise bad_field(tc_key, f"{tool_choice!r} needs `tools`", "invalid_value")
        if mode == "function":
            functions = [(i, f) for i, f in functions if f["name"] == name]
            if not functions:
                raise bad_field(tc_key, f"names the function {name!r}, which is not among the tools", "invalid_value")
        _check_parameters(functions, tools_key)
        calls = [(f["name"], f.get("parameters")) for _, f in functions]
        return StructuredSpec.tool_calls(calls, required=True, max_calls=1 if one or mode == "function" else None), \
            tc_key
    strict = [(i, f) for i, f in functions if f.get("strict")]
    if mode == "none" or not functions or (not strict and content is None):
        if content is None:
            return None, rf_key
        return (StructuredSpec.json_object() if content == {"type": "object"} else
                StructuredSpec.json_schema(content)), rf_key
    _check_parameters(strict, tools_key)
    calls = [(f["name"], f.get("parameters") if f.get("strict") else None) for _, f in functions]
    return StructuredSpec.tool_calls(calls, required=False, content=content, max_calls=1 if one else None), tc_key


def _content_schema(response_format: Any, key: str) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks the reply to follow (None: free text)."""
    if response_format is None:
        return None
    try:
        fmt = msgspec.convert(response_format, ResponseFormat)
    except msgspec.ValidationError as exc:
        raise bad_field(key, f"{_where(exc, key)} (the formats: text, json_object, json_schema)",
                        "invalid_value") from None
    if isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat) or fmt.json_schema.schema is None:
        return {"type": "object"}
    if (why := schema_error(fmt.json_schema.schema)) is not None:
        raise bad_field(key, f"json_schema.schema cannot be followed: {why}", "invalid_value")
    return fmt.json_schema.schema


def _tool_choice(choice: Any, key: str) -> tuple[str | None, str | None]:
    """(mode, function name): mode None (not given), "auto", "none", "required" or "function"."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, str):
        raise bad_field(key, f"must be 'auto', 'none', 'required' or a function, not {choice!r}", "invalid_value")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise bad_field(key, "'allowed_tools' is not supported: send only the allowed tools, with 'auto' or "
                             "'required'", "unsupported_value")
    try:
        named = msgspec.convert(choice, NamedToolChoice)
    except msgspec.ValidationError as exc:
        raise bad_field(key, f'a function is {{"type": "function", "function": {{"name": ...}}}}: '
                             f"{_where(exc, key)}", "invalid_value") from None
    return "function", named.function.name


def _where(exc: msgspec.ValidationError, key: str) -> str:
    """msgspec's message with its path from ``key`` (and no backquotes, so the error stays on ``key``)."""
    return str(exc).replace("`$", f"`{key}").replace("`", "")


def _check_parameters(functions: list[tuple[int, dict[str, Any]]], tools_key: str | None) -> None:
    for i, f in functions:
        parameters = f.get("parameters")
        if parameters is not None and (why := schema_error(parameters)) is not None:
            key = tools_key or f"tools[{i}].function.parameters"
            raise bad_field(key, f"the parameters of {f['name']!r} cannot be followed: {why}", "invalid_value")


def _include_usage(req: ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _chain_turn(result: TurnResult) -> ChainTurn:
    return ChainTurn(id=result.chain_id, turn=result.turn, resume_status=result.resume_status)


def _template_message(m: OpenAIMessage) -> Message:
    role = "system" if isinstance(m, DeveloperMessage) else str(m.__struct_config__.tag)
    out: Message = {"role": role, "content": text_of(m.content)}
    if isinstance(m, AssistantMessageIn) and m.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(m.tool_calls)
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
    return out


def preserve_thinking(req: ChatCompletionRequest) -> bool | None:
    """``chat_template_kwargs.preserve_thinking``, for templates that would drop earlier replies' reasoning."""
    return None if req.chat_template_kwargs is None else req.chat_template_kwargs.preserve_thinking


def enable_thinking(req: ChatCompletionRequest) -> bool | None:
    """The chat template's ``enable_thinking`` for the request (None: the template's default):
    ``chat_template_kwargs.enable_thinking``, else ``reasoning_effort`` ("none": False, another level: True)."""
    if req.chat_template_kwargs is not None and req.chat_template_kwargs.enable_thinking is not None:
        return req.chat_template_kwargs.enable_thinking
    return None if req.reasoning_effort is None else req.reasoning_effort != "none"


def _split(text: str, reasoning: ReasoningParser | None) -> tuple[str, str]:
    """(reasoning, the rest) of a whole generated text."""
    if reasoning is None:
        return "", text
    r1, c1 = reasoning.feed(text)
    r2, c2 = reasoning.finish()
    return r1 + r2, c1 + c2


def _message(text: str, finish: str, parse_calls: bool,
             reasoning: ReasoningParser | None = None) -> tuple[ChatMessage, str]:
    thought, text = _split(text, reasoning)
    if not parse_calls:
        message = ChatMessage(content=text or None)
    else:
        calls = calls_in(text)
        message = ChatMessage(content=without_calls(text) or None, tool_calls=calls or None)
        finish = "tool_calls" if calls and finish == "stop" else finish
    if thought:
        message.reasoning_content = thought
    return message, finish


def _chain_message(result: TurnResult, parse_calls: bool,
                   reasoning: ReasoningParser | None) -> tuple[ChatMessage, str]:
    """A chain turn's message as the stateless route gives one, with the chain's calls and their ids (the chain
    matches its tool results to them by id): those of the text after the think block, its last ones."""
    message, finish = _message(result.message.content, result.finish_reason, parse_calls, reasoning)
    if parse_calls:
        chain_calls = result.message.tool_calls
        n = min(len(message.tool_calls or []), len(chain_calls))
        message.tool_calls = chain_calls[len(chain_calls) - n:] or None
    return message, finish
