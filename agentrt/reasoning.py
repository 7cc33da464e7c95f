"""Reasoning ("thinking") out of generated text: a model that thinks (Qwen3, DeepSeek-R1 and their kin) writes
``<think> ... </think>`` before its answer, and the routes return that text apart from the answer (chat
completions' ``reasoning_content``, a Responses ``reasoning`` item, Anthropic ``thinking`` blocks).

A model thinks when ``<think>`` and ``</think>`` are tokens of its vocabulary (``think_tokens``); for any other
model nothing is split. A think block counts only at the start of the generated text (leading whitespace
allowed); one the prompt itself left open counts too: some chat templates put ``<think>\\n`` in the generation
prompt (``opens_think``), so the generated text starts inside the block and closes it with ``</think>``. A block
that never closes (``max_tokens`` cut it) is reasoning to the end.

``ReasoningParser`` splits text fed in any pieces into reasoning and content, releasing text as soon as no
continuation can change where it belongs: a possible partial tag is held back, and so is whitespace that the
split may still drop. The reasoning is the block's text stripped of surrounding whitespace; the content is what
follows the block, its leading whitespace dropped (the ``\\n\\n`` a template writes after ``</think>``), or the
whole text, as generated, when there is no block. Feeding a text in any pieces, then ``finish()``, gives the
same split as ``split_reasoning`` on the whole.

The split is of the API's output only: a chain's token log keeps the reasoning tokens as generated (the KV is of
the tokens the model produced).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_START, _REASONING, _AFTER, _CONTENT = range(4)


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    open_id: int
    close_id: int


def think_tokens(tokenizer: Any) -> ThinkTokens | None:
    """The ids of ``<think>`` and ``</think>`` when both are tokens of the tokenizer's vocabulary (the model
    thinks), else None."""
    vocab = tokenizer.get_vocab()
    open_id, close_id = vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE)
    return None if open_id is None or close_id is None else ThinkTokens(open_id, close_id)


def opens_think(prompt_ids: Sequence[int], think: ThinkTokens, stop_ids: Container[int]) -> bool:
    """Whether the prompt leaves a think block open: in its generation prompt (the tokens after its last stop
    token, ``<|im_end|>``; an assistant prefix included) the last think tag is ``<think>``."""
    for token in reversed(prompt_ids):
        if token == think.open_id:
            return True
        if token == think.close_id or token in stop_ids:
            return False
    return False


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Generated text, fed in pieces, split into (reasoning, content) deltas. ``opened``: the prompt left a think
    block open (``opens_think``), so the text starts as reasoning (a ``<think>`` the model writes anyway, at the
    start, is dropped)."""

    def __init__(self, opened: bool = False):
        self._opened = opened
        self._state = _START
        self._pending = ""  # undecided text: leading whitespace, a partial tag
        self._space = ""  # reasoning whitespace held back until more reasoning follows (the block's end drops it)
        self._started = False  # reasoning other than whitespace was released
        self.found = opened  # a think block was seen (possibly empty)
        self.closed = False  # the block's closing tag was seen
        self.reasoning = ""  # every reasoning delta so far, joined

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that this piece of text releases."""
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back is decided (a partial tag is text; trailing reasoning
        whitespace is dropped)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            text = self._pending
            if self._state == _START:
                head = text.lstrip()
                if head.startswith(THINK_OPEN):
                    self._state, self.found, self._pending = _REASONING, True, head[len(THINK_OPEN):]
                elif not final and (not head or THINK_OPEN.startswith(head)):
                    break  # whitespace, or the start of the tag: undecided
                else:
                    self._state = _REASONING if self._opened else _CONTENT
                continue
            if self._state == _REASONING:
                at = text.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(self._reasoning(text[:at], ends=True))
                    self._state, self.closed, self._pending = _AFTER, True, text[at + len(THINK_CLOSE):]
                    continue
                keep = 0 if final else _partial(text, THINK_CLOSE)
                reasoning.append(self._reasoning(text[:len(text) - keep], ends=final))
                self._pending = text[len(text) - keep:]
                break
            if self._state == _AFTER:
                head = text.lstrip()
                self._pending = head
                if not head:
                    break
                self._state = _CONTENT
                continue
            content.append(text)
            self._pending = ""
            break
        out = "".join(reasoning)
        self.reasoning += out
        return out, "".join(content)

    def _reasoning(self, piece: str, ends: bool) -> str:
        """Reasoning text to release: the block's leading whitespace dropped, trailing whitespace held back
        (dropped when the block ends here)."""
        text = self._space + piece
        self._space = ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        released = text.rstrip()
        if not ends:
            self._space = text[len(released):]
        return released


def parser(thinking: bool | None) -> ReasoningParser | None:
    """A parser for a reply, from ``ChatRenderer.thinking(prompt)``: None (the model does not think) gives none."""
    return None if thinking is None else ReasoningParser(thinking)


def split_reasoning(text: str, opened: bool | None = None) -> tuple[str, str]:
    """``text`` (the whole generated text) as (reasoning, content); ``reasoning`` is "" when there is none.
    ``opened`` None: inferred from the text alone, for a text whose prompt is not at hand (a chain turn's stored
    content): open when a ``</think>`` comes before any ``<think>``."""
    if opened is None:
        at = text.find(THINK_CLOSE)
        opened = at >= 0 and THINK_OPEN not in text[:at]
    parser = ReasoningParser(opened)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2


def answer_of(text: str) -> str:
    """A generated text without its reasoning (``split_reasoning`` with the block inferred from the text): what
    the routes return as the message's text."""
    if THINK_OPEN not in text and THINK_CLOSE not in text:
        return text
    return split_reasoning(text)[1]


def think_blocks(token_ids: Sequence[int], think: ThinkTokens,
                 decode: Callable[[list[int]], str]) -> list[tuple[int, int]]:
    """The closed think blocks of a token log as ``[start, end)`` spans: ``<think>`` through ``</think>`` and the
    newline-only tokens after it (what a template drops with the block: Qwen3's ``.lstrip('\\n')``)."""
    blocks, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] != think.open_id:
            i += 1
            continue
        j = next((m for m in range(i + 1, n) if token_ids[m] == think.close_id), None)
        if j is None:
            break  # an unterminated block (max_tokens cut it) is text to a template
        k = j + 1
        while k < n and (text := decode([token_ids[k]])) and not text.strip("\n"):
            k += 1
        blocks.append((i, k))
        i = k
    return blocks


@dataclass(frozen=True, slots=True)
class ThinkLog:
    """A chain's token log cut at its think blocks, decoded once: for matching a chat template's rendering of
    the conversation that leaves some of those blocks out."""

    spans: list[tuple[int, int]]  # the closed think blocks
    blocks: list[str]  # their text
    segments: list[str]  # the text before each block, then after the last
    interiors: list[tuple[int, int]]  # each block's reasoning: the tokens between its tags
    emptied: list[str]  # each block with its reasoning left out: the tags, then the newlines after them

    @classmethod
    def of(cls, token_ids: Sequence[int], think: ThinkTokens, decode: Callable[[list[int]], str]) -> ThinkLog:
        spans = think_blocks(token_ids, think, decode)
        cuts = [0] + [x for span in spans for x in span] + [len(token_ids)]
        segments = [decode(list(token_ids[cuts[i]:cuts[i + 1]])) for i in range(0, len(cuts), 2)]
        closes = [next(m for m in range(a, b) if token_ids[m] == think.close_id) for a, b in spans]
        return cls(spans, [decode(list(token_ids[a:b])) for a, b in spans], segments,
                   [(a + 1, j) for (a, _), j in zip(spans, closes)],
                   [THINK_OPEN + THINK_CLOSE + decode(list(token_ids[j + 1:b])) for (_, b), j in zip(spans, closes)])

    def dropped_in(self, rendering: str, tail: str) -> tuple[int, list[tuple[int, int]]] | None:
        """Whether ``rendering`` begins with the log, then ``tail`` (what closes its last message), less some of
        its reasoning: a template that drops earlier replies' think blocks (Qwen3's drops every think block
        before the last user message and, in a tool loop, the empty ones) or empties them (GLM's writes
        ``<think></think>`` there). Returns where the log ends in ``rendering`` and the spans of the dropped
        tokens (a block, or an emptied block's reasoning); None when the rendering differs from the log otherwise
        or drops nothing."""
        pos, dropped = 0, []
        for segment, span, block, interior, emptied in zip(self.segments, self.spans, self.blocks, self.interiors,
                                                           self.emptied):
            if not rendering.startswith(segment, pos):
                return None
            pos += len(segment)
            if rendering.startswith(block, pos):
                pos += len(block)
            elif interior[0] < interior[1] and rendering.startswith(emptied, pos):
                pos += len(emptied)
                dropped.append(interior)
            else:
                dropped.append(span)
        rest = self.segments[-1] + tail
        if not dropped or not rendering.startswith(rest, pos):
            return None
        return pos + len(rest), dropped
