"""A chat completion's reply: its message read from the generated text, its log-probabilities and its usage.

The message is the generated text split by the model's tool-call syntax (agentrt.tool_syntax): ``content`` is the
text without its calls (None when nothing is left), ``tool_calls`` the calls, and a stop with calls finishes as
``tool_calls``. ``tool_choice: "none"`` leaves the text unparsed: the content is the text as
generated, markup and all. A model that thinks (agentrt.reasoning) has its think block split off first:
``message.reasoning_content`` carries it, the content and the calls are read from what follows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentrt.engine_worker import prefill_counts
from agentrt.errors import TurnFailed
from agentrt.openai_types import (ChainTurn, ChatMessage, ChoiceLogprobs, CompletionUsage, PromptTokensDetails,
                                  TokenLogprob, TopLogprob)
from agentrt.reasoning import ReasoningParser
from agentrt.tool_syntax import ToolCallReader
from engine.outputs import RequestOutput
from sdk.schema import TurnResult

_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability zero (JSON has no -inf)


def _split(text: str, reasoning: ReasoningParser | None) -> tuple[str, str]:
    """(reasoning, the rest) of a whole generated text."""
    if reasoning is None:
        return "", text
    r1, c1 = reasoning.feed(text)
    r2, c2 = reasoning.finish()
    return r1 + r2, c1 + c2


def text_message(text: str, finish: str, reader: ToolCallReader | None,
                 reasoning: ReasoningParser | None = None) -> tuple[ChatMessage, str]:
    """The message of a whole generated text, and the finish reason (``tool_calls`` for a stop with calls);
    ``reader`` None: the text is the content, calls unread."""
    thought, text = _split(text, reasoning)
    if reader is None:
        message = ChatMessage(content=text or None)
    else:
        calls = reader.calls_in(text)
        message = ChatMessage(content=reader.without_calls(text) or None, tool_calls=calls or None)
        finish = "tool_calls" if calls and finish == "stop" else finish
    if thought:
        message.reasoning_content = thought
    return message, finish


def chain_message(result: TurnResult, reader: ToolCallReader | None,
                  reasoning: ReasoningParser | None) -> tuple[ChatMessage, str]:
    """A chain turn's message as the stateless route gives one, with the chain's calls and their ids (the chain
    matches its tool results to them by id): those of the text after the think block, its last ones."""
    message, finish = text_message(result.message.content, result.finish_reason, reader, reasoning)
    if reader is not None:
        chain_calls = result.message.tool_calls
        n = min(len(message.tool_calls or []), len(chain_calls))
        message.tool_calls = chain_calls[len(chain_calls) - n:] or None
    return message, finish


def chain_turn(result: TurnResult) -> ChainTurn:
    return ChainTurn(id=result.chain_id, turn=result.turn, resume_status=result.resume_status)


def choice_logprobs(tokens: TokenText, top_n: int, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                    top: Sequence[Sequence[tuple[int, float]]] | None) -> ChoiceLogprobs:
    """A choice's ``logprobs``: per token its text, bytes and log-probability, and its ``top_n`` alternatives."""
    entries = []
    for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs or [])):
        text, raw = tokens(token_id)
        alternatives = []
        for alt_id, alt_logprob in (top[k][:top_n] if top and top_n else []):
            alt_text, alt_raw = tokens(alt_id)
            alternatives.append(TopLogprob(token=alt_text, logprob=_finite(alt_logprob), bytes=alt_raw))
        entries.append(TokenLogprob(token=text, logprob=_finite(logprob), bytes=raw, top_logprobs=alternatives))
    return ChoiceLogprobs(content=entries)


def request_usage(out: RequestOutput) -> CompletionUsage:
    """The usage of a stateless request's last output."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


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
