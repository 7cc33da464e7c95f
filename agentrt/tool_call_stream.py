"""Tool calls out of streamed text, incrementally, with the rules of agentrt.chat (``calls_in``,
``without_calls``): feeding a text in any number of pieces, then ``finish()``, yields as content exactly
``without_calls(text)`` and as calls exactly ``calls_in(text)`` (ids aside). The text is a reply's content: its
reasoning is split off before (agentrt.reasoning.ReasoningParser).

Text is released as soon as no continuation can change it: a possible partial ``<tool_call>`` tag at the end
is held back, and so is everything from a ``<tool_call>`` that a continuation could still complete into a
block (the tag, optional whitespace, then ``{``: the block ends at the first ``}`` that the closing tag
follows, however far away). A block found in the text so far is final (a longer text cannot end it
earlier), so its call is released at once. Whitespace is held back where ``strip`` could still remove it:
before the first other character, and at the end until another character follows.
"""

from __future__ import annotations

import re

from agentrt.chat import TOOL_CALL_RE, tool_call_from_json
from sdk.schema import ToolCall

OPEN_TAG = "<tool_call>"
_MAY_MATCH = re.compile(r"<tool_call>\s*(?:\{|\Z)")  # a block may still start here, given more text


def _partial_tag(text: str, start: int) -> int:
    """How many characters at the end of ``text[start:]`` are a proper prefix of the opening tag."""
    for k in range(min(len(OPEN_TAG) - 1, len(text) - start), 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            return k
    return 0


class ToolCallStream:
    def __init__(self) -> None:
        self._pending = ""  # undecided text: a possible (partial) block onwards
        self._space = ""  # content whitespace that only non-whitespace content after it releases
        self._started = False  # content other than whitespace was released
        self.calls: list[ToolCall] = []  # every call found so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content released by this piece of text, and the calls it completed."""
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: what was held back is decided (trailing whitespace is dropped)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        text, pos = self._pending, 0
        pieces: list[str] = []
        calls: list[ToolCall] = []
        while True:
            i = text.find(OPEN_TAG, pos)
            if i < 0:
                end = len(text) - (0 if final else _partial_tag(text, pos))
                pieces.append(text[pos:end])
                pos = end
                break
            pieces.append(text[pos:i])
            if (m := TOOL_CALL_RE.match(text, i)) is not None:
                if (call := tool_call_from_json(m.group(1))) is not None:
                    calls.append(call)
                pos = m.end()
            elif not final and _MAY_MATCH.match(text, i):
                pos = i
                break
            else:  # no block starts here: the tag is text (blocks cannot overlap the tag itself)
                pieces.append(OPEN_TAG)
                pos = i + len(OPEN_TAG)
        self._pending = text[pos:]
        self.calls.extend(calls)
        return self._content("".join(pieces), final), calls

    def _content(self, piece: str, final: bool) -> str:
        if not self._started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._started = True
        text = self._space + piece
        released = text.rstrip()
        self._space = "" if final else text[len(released):]
        return released
