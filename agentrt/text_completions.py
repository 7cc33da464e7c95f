"""OpenAI's legacy text completions (``POST /v1/completions``): a prompt (text or token ids) continued as raw text,
no chat template. Stateless engine requests, as chat completions are without a chain: the engine's prefix cache
reuses the pages of a prompt prefix it has seen (``usage.prompt_tokens_details.cached_tokens``).

A request may carry a batch of prompts (a list of strings, or a list of token-id lists) and ``n`` choices per
prompt: each choice is its own engine request, all submitted together; choice ``i * n + j`` is prompt ``i``'s
``j``-th (OpenAI's order). With a ``seed``, choice ``j`` samples with ``seed + j``, so that the ``n`` choices of a
prompt differ as they do without one. ``logprobs: K`` is the legacy form (``tokens``, ``token_logprobs``,
``top_logprobs`` as ``{token: logprob}`` of the K most likely tokens, ``text_offset``), the engine's values as on
the chat route. ``echo`` puts the prompt's text before the completion; the engine computes no log-probabilities
of prompt tokens, so ``echo`` with ``logprobs`` is refused. Errors are OpenAI's error object, ``param`` naming the
field (``prompt[1]``, ``max_tokens``); docs/server.md ("Text completions") tables every field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from agentrt.completions_input import checked_forced_tokens, sampling_knobs
from agentrt.completions_output import TokenText, finished_output
from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineWorker, RequestStream
from agentrt.errors import ModelNotFound, bad_field, openai_error_body
from agentrt.metrics import Metrics
from agentrt.openai_types import (CompletionUsage, PromptTokensDetails, TextChoice, TextCompletion,
                                  TextCompletionRequest, TextLogprobs)
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agentrt.render_pool import RenderPool

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route
MAX_CHOICES = 128  # prompts x n in one request (OpenAI's bound on n)
_SEED_MOD = 2**63
_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability zero (JSON has no -inf)


class PromptTooLarge(HTTPException):
    """413 naming ``prompt``: more characters than the server tokenizes at once (as RenderPool's for messages)."""

    status_code = 413

    def __init__(self, chars: int, limit: int, max_model_len: int):
        message = (f"the prompts hold {chars} characters as JSON, more than this server takes at once ({limit}: "
                   f"{limit // max_model_len} per token of the model's {max_model_len}-token context)")
        super().__init__(detail=f"prompt: {message}", extra=[{"message": message, "key": "prompt",
                                                             "source": "body"}])


@dataclass(slots=True)
class Prompt:
    key: str  # the request field it came from (``prompt``, ``prompt[2]``)
    text: str | None  # as sent (None: sent as token ids)
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Choice:
    index: int
    prompt: Prompt
    stream: RequestStream
    echo: str = ""  # the text before the completion's (the prompt's, with ``echo``)
    offset: int = 0  # characters of this choice's text so far (``text_offset``)


@dataclass(slots=True)
class TextRun:
    id: str
    created: int
    model: str
    prompts: list[Prompt]
    choices: list[Choice]
    include_usage: bool
    logprobs: int | None  # K, or None without ``logprobs``

    async def abort(self) -> None:
        """For a response that ended before its streams were consumed (client gone)."""
        for c in self.choices:
            if not c.stream.done:
                c.stream.done = True
                c.stream.worker.abort(c.stream.request_id)


class TextCompletionService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: RenderPool,
                 metrics: Metrics, tokens: TokenText):
        self.config = config
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.metrics = metrics
        self.tokens = tokens
        self.tokenizer = renderer.renderer.tokenizer

    # --- the request ----------------------------------------------------------------------------------------
    async def start(self, req: TextCompletionRequest) -> TextRun:
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        check_supported(req)
        n = req.n or 1
        prompts = _prompts(req.prompt)
        if len(prompts) * n > MAX_CHOICES:
            key = "n" if n > 1 else "prompt"
            raise bad_field(key, f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} choices, more than "
                                 f"{MAX_CHOICES} in one request", "invalid_value")
        base = self._params(req)
        await self._tokenize(prompts)
        vocab, limit = self.worker.engine.model_config.vocab_size, self.renderer.max_model_len
        for p in prompts:
            if not p.token_ids:
                raise bad_field(p.key, "the prompt has no tokens: send some text or token ids", "invalid_value")
            if (bad := next((k for k, t in enumerate(p.token_ids) if t >= vocab), None)) is not None:
                key = p.key if p.text is not None else f"{p.key}[{bad}]"
                raise bad_field(key, f"token id {p.token_ids[bad]} is not below the vocabulary size {vocab}",
                                "invalid_value")
            if len(p.token_ids) >= limit:
                raise bad_field(p.key, f"the prompt has {len(p.token_ids)} tokens; the model's context is {limit} "
                                       "(at least one token must be left to generate)", "context_length_exceeded")
        echo = [self._echo(p) if req.echo else "" for p in prompts]
        run = TextRun(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, prompts, [],
                      bool(req.stream_options and req.stream_options.include_usage), req.logprobs)
        try:
            for i, p in enumerate(prompts):
                for j in range(n):
                    params = base if j == 0 or req.seed is None else \
                        dataclasses.replace(base, seed=(req.seed + j) % _SEED_MOD)
                    stream = await self._submit(p, params)
                    run.choices.append(Choice(i * n + j, p, stream, echo[i], len(echo[i])))
        except BaseException:
            await run.abort()
            raise
        return run

    def _params(self, req: TextCompletionRequest) -> SamplingParams:
        # a larger request is lowered to the limit and to what the context holds (finish_reason "length" there)
        max_tokens = min(req.max_tokens or DEFAULT_MAX_TOKENS, self.config.max_tokens_per_turn)
        forced = checked_forced_tokens(req.forced_token_ids, max_tokens, self.worker.engine.model_config.vocab_size)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                **sampling_knobs(req),
                seed=req.seed, max_tokens=max_tokens, stop=stop, forced_token_ids=forced,
                ignore_eos=bool(req.ignore_eos), logprobs=req.logprobs is not None,
                top_logprobs=req.logprobs or 0, fit_max_tokens=True)
        except InvalidSamplingParamsError as exc:  # named by its first word: the engine's field name
            name = str(exc).split(" ", 1)[0]
            raise bad_field({"top_logprobs": "logprobs"}.get(name, name), str(exc), "invalid_value") from None

    async def _tokenize(self, prompts: list[Prompt]) -> None:
        """The token ids of the prompts sent as text, on the render pool's threads, after the size check."""
        texts = [p for p in prompts if p.text is not None]
        if not texts:
            return
        chars = sum(len(msgspec.json.encode(p.text)) for p in texts)
        if chars > self.renderer.max_chars:
            raise PromptTooLarge(chars, self.renderer.max_chars, self.renderer.max_model_len)

        def encode() -> list[list[int]]:  # the engine's own reading of a text prompt (special tokens added)
            return [list(self.tokenizer.encode(p.text)) if p.text else [] for p in texts]

        for p, ids in zip(texts, await self.renderer._run(encode)):
            p.token_ids = ids

    def _echo(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids, skip_special_tokens=False)

    async def _submit(self, p: Prompt, params: SamplingParams) -> RequestStream:
        try:
            return await self.worker.submit(p.token_ids, params)
        except InvalidSamplingParamsError:
            raise
        except InvalidRequestError as exc:  # the prompt: longer than the KV pool holds
            message = str(exc)
            code = "context_length_exceeded" if "max_model_len" in message or "KV pages" in message else \
                "invalid_value"
            raise bad_field(p.key, message, code) from None

    # --- the response ---------------------------------------------------------------------------------------
    async def complete(self, run: TextRun) -> TextCompletion:
        try:
            lasts = await asyncio.gather(*(_last(c.stream) for c in run.choices))
        finally:
            await run.abort()  # what is still running after a failure or a cancellation
        choices = []
        for c, last in zip(run.choices, lasts):
            last = self._finished(last)
            logprobs = None
            if run.logprobs is not None:
                logprobs = self._logprobs(run, c, last.token_ids, last.logprobs, last.top_logprobs)
            choices.append(TextChoice(text=c.echo + last.text, index=c.index, logprobs=logprobs,
                                      finish_reason=_finish(last)))
        return TextCompletion(id=run.id, created=run.created, model=run.model, choices=choices,
                              usage=self._usage(run, lasts))

    async def chunks(self, run: TextRun) -> AsyncGenerator[str, None]:
        """The SSE data of a streamed completion: each choice's text as it is generated (the echoed prompt first),
        its last chunk with the finish reason, the usage chunk (``include_usage``: no choices, the others carry
        ``usage: null``), ``[DONE]``. An error once the stream has started is an event of OpenAI's error
        object, and the stream ends without ``[DONE]``."""
        def chunk(choices: list[TextChoice], usage: CompletionUsage | None = None) -> str:
            body = TextCompletion(id=run.id, created=run.created, model=run.model, choices=choices, usage=usage)
            return msgspec.json.encode(body).decode()

        queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async with aclosing(c.stream.outputs()) as outputs:
                    async for out in outputs:
                        await queue.put((c, out))
                await queue.put((c, None))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((c, exc))

        tasks: list[asyncio.Task[None]] = []
        try:
            for c in run.choices:
                if c.echo:
                    yield chunk([TextChoice(text=c.echo, index=c.index, logprobs=None, finish_reason=None)])
            tasks = [asyncio.ensure_future(pump(c)) for c in run.choices]
            lasts: dict[int, RequestOutput | None] = {}
            open_ = len(run.choices)
            while open_:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    open_ -= 1
                    last = self._finished(lasts.get(c.index))
                    lasts[c.index] = last
                    yield chunk([TextChoice(text="", index=c.index, logprobs=None, finish_reason=_finish(last))])
                    continue
                lasts[c.index] = item
                logprobs = None
                if run.logprobs is not None and item.new_token_ids:
                    k = len(item.new_token_ids)
                    top = item.top_logprobs
                    logprobs = self._logprobs(run, c, item.new_token_ids, (item.logprobs or [])[-k:],
                                              top[-k:] if top else None)
                if item.new_text or logprobs is not None:
                    yield chunk([TextChoice(text=item.new_text, index=c.index, logprobs=logprobs,
                                            finish_reason=None)])
            if run.include_usage:
                yield chunk([], usage=self._usage(run, [lasts[c.index] for c in run.choices]))
            yield "[DONE]"
        except Exception as exc:  # the status line is sent: the error goes into the stream
            log.info("stream %s failed: %r", run.id, exc)
            yield msgspec.json.encode(openai_error_body(exc)).decode()
        finally:
            for t in tasks:
                t.cancel()
            await run.abort()

    def _finished(self, last: RequestOutput | None) -> RequestOutput:
        return finished_output(last, self.metrics)

    def _logprobs(self, run: TextRun, c: Choice, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> TextLogprobs:
        """The legacy entries of ``token_ids`` (generated in this order), ``c.offset`` advancing past each."""
        k = run.logprobs or 0
        out = TextLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs or [])):
            text = self.tokens(token_id)[0]
            alternatives: dict[str, float] = {}
            for alt_id, alt_logprob in (top[i][:k] if top and k else []):
                alternatives.setdefault(self.tokens(alt_id)[0], _finite(alt_logprob))
            alternatives.setdefault(text, _finite(logprob))  # the sampled token is always there
            out.tokens.append(text)
            out.token_logprobs.append(_finite(logprob))
            out.top_logprobs.append(alternatives)
            out.text_offset.append(c.offset)
            c.offset += len(text)
        return out

    @staticmethod
    def _usage(run: TextRun, lasts: Sequence[RequestOutput | None]) -> CompletionUsage:
        """Each prompt counted once (with its first choice's cached tokens), every choice's completion."""
        by_choice = {c.index: last for c, last in zip(run.choices, lasts)}
        prompt = cached = 0
        seen: set[int] = set()
        completion = 0
        for c in run.choices:
            last = by_choice[c.index]
            completion += len(last.token_ids) if last is not None else 0
            if id(c.prompt) not in seen:
                seen.add(id(c.prompt))
                prompt += len(c.prompt.token_ids)
                cached += last.num_cached_tokens if last is not None else 0
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


async def _last(stream: RequestStream) -> RequestOutput | None:
    last = None
    async with aclosing(stream.outputs()) as outputs:
        async for out in outputs:
            last = out
    return last


def _finish(out: RequestOutput) -> Any:
    return "length" if out.finish_reason == "length" else "stop"


def _prompts(prompt: str | list[Any]) -> list[Prompt]:
    """The request's prompts: one string, one list of token ids, or a batch of either (not a mix)."""
    if isinstance(prompt, str):
        return [Prompt("prompt", prompt)]
    kinds = {str if isinstance(p, str) else int if isinstance(p, int) else list for p in prompt}
    if len(kinds) > 1:
        raise bad_field("prompt", "a string, a list of token ids, a list of strings or a list of token-id lists, "
                                  "not a mix", "invalid_value")
    if int in kinds:
        return [Prompt("prompt", None, list(prompt))]
    if str in kinds:
        return [Prompt(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
    return [Prompt(f"prompt[{i}]", None, list(p)) for i, p in enumerate(prompt)]


def check_supported(req: TextCompletionRequest) -> None:
    """Refuse, with a 400 naming the field, what this server cannot do as OpenAI would (docs/server.md has the
    table of every request field)."""
    def refuse(key: str, why: str, code: str = "unsupported_value") -> None:
        raise bad_field(key, why, code)

    if req.suffix:
        refuse("suffix", "insertion (a text after the completion) is not supported: leave it out",
               "unsupported_parameter")
    if req.best_of is not None and req.best_of != (req.n or 1):
        refuse("best_of", "must equal n or be left out: no choice is ranked and dropped here")
    for key in ("frequency_penalty", "presence_penalty"):
        if getattr(req, key):
            refuse(key, "must be 0 or left out: the engine applies no penalties")
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
        refuse("repetition_penalty", "must be 1.0 or left out: the engine applies no penalties")
    if req.logit_bias:
        refuse("logit_bias", "must be empty or left out: the engine applies no logit bias")
    if req.echo and req.logprobs is not None:
        refuse("echo", "echo with logprobs would need the prompt tokens' log-probabilities, which the engine does "
                       "not compute: leave out one of the two")


def text_completions_service(state: State) -> TextCompletionService:
    """The app's TextCompletionService, made on first use from what the lifespan put on ``app.state``."""
    service = getattr(state, "text_completions", None)
    if service is None:
        completions = state.completions
        service = TextCompletionService(state.config, state.model_name, state.worker, completions.renderer,
                                        state.metrics, completions.tokens)
        state.text_completions = service
    return service
