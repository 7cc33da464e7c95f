"""Chat rendering onto an append-only token log.

New messages are rendered with the model's chat template: the conversation is rendered before and after
adding them, the old rendering must be a prefix of the new one (true of ChatML), and only the new suffix is
tokenized and appended. A template that drops earlier replies' think blocks (Qwen3's) or empties them (GLM's) is
matched against the log less those blocks or their reasoning (``agentrt.reasoning.ThinkLog``); the caller prunes
them from the KV (``Appended.dropped``). Each message's share of that suffix becomes one region. Generated tokens
are never re-tokenized: the previous assistant message is closed by appending what the template puts after its
content (``<|im_end|>\\n``, minus a stop token the model already produced); where nothing follows a reply's content
and the next message opens with the stop token the model ended on (GLM's role tags), that token is not appended
again.

Per-request template arguments (``enable_thinking``: agentrt.reasoning) reach every rendering inside
``template_kwargs(...)``, a context variable, so they follow a request through the chain service into the render
threads. The text a route returns for an assistant message is its content without its reasoning block and its
tool-call blocks, and its calls are read in that content only, both in the model's tool-call syntax
(``ChatRenderer.tool_syntax``: agentrt.tool_syntax).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from agentrt.reasoning import THINK_CLOSE, THINK_OPEN, ThinkLog, opens_think, think_tokens
from agentrt.tool_syntax import ToolSyntax, detect
from sdk.schema import RegionKind

Message = dict[str, Any]

_KINDS: dict[str, RegionKind] = {"system": "system", "user": "user", "tool": "tool_result", "assistant": "assistant"}
_TEMPLATE_KWARGS: ContextVar[dict[str, Any]] = ContextVar("chat_template_kwargs", default={})
_MARK = "\u2063agentrt-end-of-content\u2063"  # located in a rendering: where an assistant message's content ends


@contextmanager
def template_kwargs(**kwargs: Any) -> Iterator[None]:
    """Renderings inside pass ``kwargs`` (those not None) to the chat template, e.g. ``enable_thinking``."""
    token = _TEMPLATE_KWARGS.set({k: v for k, v in kwargs.items() if v is not None})
    try:
        yield
    finally:
        _TEMPLATE_KWARGS.reset(token)


class TemplateMismatchError(ValueError):
    """The chat template re-renders earlier messages differently once new ones follow (not append-only)."""


@dataclass(slots=True)
class Piece:
    kind: RegionKind
    token_ids: list[int]
    message: Message


@dataclass(slots=True)
class Appended:
    close_ids: list[int]  # closes the previous assistant message (its region grows by these)
    pieces: list[Piece]  # one per new message
    prompt_ids: list[int]  # the generation prompt and the assistant prefix: the new assistant region starts here
    token_ids: list[int] = field(default_factory=list)  # all of the above, in order
    dropped: list[tuple[int, int]] = field(default_factory=list)  # log spans the template leaves out (think blocks)

    def __post_init__(self) -> None:
        self.token_ids = self.close_ids + [t for p in self.pieces for t in p.token_ids] + self.prompt_ids


class ChatRenderer:
    """Owns its own tokenizer instance: the engine thread uses the engine's for detokenization."""

    def __init__(self, tokenizer: Any, stop_token_ids: Iterable[int], tool_syntax: ToolSyntax | None = None):
        self.tokenizer = tokenizer
        # how the model spells tool calls: what the template shows unless the server names one
        self.tool_syntax = tool_syntax or detect(getattr(tokenizer, "chat_template", None))
        tokenizer.model_max_length = 2**62  # length limits are the engine's to enforce, with a clear error
        self.stop_token_ids = frozenset(stop_token_ids)
        self._added = sorted({str(t) for t in tokenizer.get_added_vocab()}, key=len, reverse=True)
        self.think = think_tokens(tokenizer)  # None: the model does not think (agentrt.reasoning)
        # a tokenizer whose tool-call or think tags are special tokens (GLM's): the engine must keep special
        # tokens in the text, or the tags vanish from it (SamplingParams.skip_special_tokens)
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        self.keeps_special_tokens = bool(special & {*self.tool_syntax.markup, THINK_OPEN, THINK_CLOSE})

    def render(self, messages: list[Message], tools: list[dict] | None, generation_prompt: bool = False) -> str:
        messages = [self._for_template(m) for m in messages]
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **_TEMPLATE_KWARGS.get())

    def _for_template(self, message: Message) -> Message:
        """``message`` with its calls' arguments in the form the template takes (a mapping for templates that
        iterate them, agentrt.tool_syntax)."""
        calls = message.get("tool_calls")
        if not calls or not self.tool_syntax.template_mapping:
            return message
        convert = self.tool_syntax.template_arguments
        return {**message, "tool_calls": [
            {**c, "function": {**c["function"], "arguments": convert(c["function"].get("arguments"))}}
            if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in calls]}

    def thinking(self, prompt_ids: Sequence[int]) -> bool | None:
        """None when the model does not think; else whether ``prompt_ids`` leave a think block open (the text
        generated after them starts as reasoning): ``agentrt.reasoning.parser`` takes it."""
        return None if self.think is None else opens_think(prompt_ids, self.think, self.stop_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def prompt(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def append(self, history: list[Message], new: list[Message], tools: list[dict] | None,
               last_token: int | None = None, assistant_prefix: str | None = None,
               log_ids: Sequence[int] | None = None) -> Appended:
        """Tokens that extend a log holding ``history`` (its last assistant message as generated) by ``new``.
        ``log_ids``, the log itself, lets a template that drops earlier replies' reasoning append anyway: the
        dropped think blocks are returned (``Appended.dropped``) for the caller to take out of the KV."""
        base = self.render(history, tools) if history else ""
        close = self._close(history, tools, base, last_token) if history and history[-1]["role"] == "assistant" else ""
        final = self.render(history + new, tools, generation_prompt=True)
        log = ThinkLog.of(log_ids, self.think, self.decode) \
            if log_ids and self.think is not None and not final.startswith(base) else None
        opening = self._stop_opening(history, last_token, close)
        start, dropped = self._history_end(final, base, close, log, opening)
        pieces, pos, tail = [], start, final[start:]
        for i, message in enumerate(new):
            upto = self.render(history + new[: i + 1], tools)
            at = self._history_end(upto, base, close, log, opening)[0]
            end = self._safe_boundary(final, start + _common_prefix(upto[at:], tail, pos - start))
            end = max(end, pos)
            pieces.append(Piece(_KINDS[message["role"]], self.encode(final[pos:end]), message))
            pos = end
        return Appended(self.encode(close), pieces, self.encode(final[pos:] + (assistant_prefix or "")),
                        dropped=dropped)

    @staticmethod
    def _history_end(rendering: str, base: str, close: str, log: ThinkLog | None,
                     opening: str = "") -> tuple[int, list[tuple[int, int]]]:
        """Where the history ends in ``rendering`` (of the history and more; past ``opening``, which the log
        holds already, where the rendering goes on with it), and the log's reasoning that the rendering leaves
        out."""
        found = (len(base), []) if rendering.startswith(base) else \
            log.dropped_in(rendering, close) if log is not None else None
        if found is None:
            raise TemplateMismatchError("the chat template does not render the conversation append-only")
        end, dropped = found
        if opening and rendering.startswith(opening, end):
            end += len(opening)
        return end, dropped

    def reply_form(self, next_role: str) -> tuple[str, int | None]:
        """How the template writes an earlier reply before a ``next_role`` message (user or tool): the text it
        puts between the generation prompt and the reply's content (GLM's ``\\n<think></think>\\n``; ChatML's
        nothing), and the stop token that ends the reply there (ChatML's ``<|im_end|>``; GLM's ``<|user|>`` or
        ``<|observation|>``), None when no stop token does. A reply this server did not generate is imported as
        that text, the reply, then that token (agentrt.implicit_chains)."""
        ask = [{"role": "user", "content": "?"}]
        follow = {"role": "tool", "content": "?", "tool_call_id": "call_0"} if next_role == "tool" else ask[0]
        try:
            prompt = self.render(ask, None, generation_prompt=True)
            whole = self.render(ask + [{"role": "assistant", "content": _MARK}, follow], None)
        except Exception:  # a template that refuses this probe: no reply can be imported
            return "", None
        at = whole.find(_MARK)
        if at < 0 or not whole.startswith(prompt):
            return "", None
        ids = self.encode(whole[at + len(_MARK):])
        return whole[len(prompt):at], ids[0] if ids and ids[0] in self.stop_token_ids else None

    def _stop_opening(self, history: list[Message], last_token: int | None, close: str) -> str:
        """The text of the stop token that ended the log's last reply where nothing closes a reply and the next
        message opens with such a token (GLM's ``<|user|>`` / ``<|observation|>``): the log holds it already."""
        if close or not history or history[-1]["role"] != "assistant" or last_token not in self.stop_token_ids:
            return ""
        return self.decode([last_token])

    def _close(self, history: list[Message], tools: list[dict] | None, base: str, last_token: int | None) -> str:
        content = history[-1]["content"]
        body = self.render(history[:-1], tools, generation_prompt=True) + content
        if base.startswith(body):
            close = base[len(body):]
        else:
            # the generation prompt holds what the message's own rendering does not (a think block the template
            # opens, or closes empty: Qwen3's empty ``<think></think>`` with enable_thinking false): what
            # follows the content in the message's rendering closes it
            marked = self.render(history[:-1] + [{**history[-1], "content": content + _MARK}], tools)
            at = marked.rfind(_MARK)
            close = marked[at + len(_MARK):]
            if at < 0 or marked[:at] + close != base:
                raise TemplateMismatchError("the chat template does not keep an assistant message's content "
                                            "verbatim")
        if last_token in self.stop_token_ids:
            stop_text = self.decode([last_token])
            close = close.removeprefix(stop_text)
        return close

    def _safe_boundary(self, text: str, pos: int) -> int:
        """Move ``pos`` back so that it does not cut through a special or added token."""
        for token in self._added:
            for k in range(1, len(token)):
                if pos - k >= 0 and text.startswith(token, pos - k):
                    return pos - k
        return pos


def _common_prefix(a: str, b: str, start: int = 0) -> int:
    n = min(len(a), len(b))
    i = start if a[:start] == b[:start] else 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
