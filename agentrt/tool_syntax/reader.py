"""A reply's tool calls under one syntax and one request's tools: whole texts (``calls_in`` / ``without_calls``)
and streamed ones (``stream``) by the same rules."""

from __future__ import annotations

from agentrt.reasoning import answer_of
from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax
from sdk.schema import ToolCall


class ToolCallReader:
    def __init__(self, syntax: ToolSyntax, tools: Tools | None = None) -> None:
        self.syntax, self.tools = syntax, list(tools or [])

    def parsed(self, text: str) -> list[ParsedCall]:
        """Every call of the whole blocks of ``text`` (malformed blocks give none), with its arguments' span."""
        return [call for match in self.syntax.blocks(text) for call in self.syntax.calls(match, self.tools)]

    def calls_in(self, text: str) -> list[ToolCall]:
        return [parsed.call for parsed in self.parsed(text)]

    def without_calls(self, text: str) -> str:
        """The text without its blocks (malformed ones too), stripped of surrounding whitespace."""
        pieces, pos = [], 0
        for match in self.syntax.blocks(text):
            pieces.append(text[pos:match.start()])
            pos = match.end()
        pieces.append(text[pos:])
        return "".join(pieces).strip()

    def reply_calls(self, text: str) -> list[ToolCall]:
        """The calls of a generated text: ``calls_in`` its answer (a leading reasoning block is not searched:
        agentrt.reasoning.answer_of)."""
        return self.calls_in(answer_of(text))

    def reply_content(self, text: str) -> str:
        """A generated text as the routes return its content: without its reasoning block and its blocks."""
        return self.without_calls(answer_of(text))

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _partial_open(open_text: str, text: str, start: int) -> int:
    """How many characters at the end of ``text[start:]`` are a proper prefix of ``open_text``."""
    for k in range(min(len(open_text) - 1, len(text) - start), 0, -1):
        if text.endswith(open_text[:k]):
            return k
    return 0


class ToolCallStream:
    """Tool calls out of streamed text, incrementally: feeding a text in any number of pieces, then ``finish()``,
    yields as content exactly ``without_calls(text)`` and as calls exactly ``calls_in(text)`` (ids aside). The
    text is a reply's content: its reasoning is split off before (agentrt.reasoning.ReasoningParser).

    Text is released as soon as no continuation can change it: a possible partial opening at the end is held
    back, and so is everything from an opening that a continuation could still complete into a block
    (``ToolSyntax.may_start``: a block ends at the first closing text, however far away). A block found in the
    text so far is final (a longer text cannot end it earlier), so its calls are released at once. Whitespace is
    held back where ``strip`` could still remove it: before the first other character, and at the end until
    another character follows."""

    def __init__(self, reader: ToolCallReader) -> None:
        self.syntax, self.tools = reader.syntax, reader.tools
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
        text, pos, syntax = self._pending, 0, self.syntax
        pieces: list[str] = []
        calls: list[ToolCall] = []
        while True:
            i = text.find(syntax.open, pos)
            if i < 0:
                end = len(text) - (0 if final else _partial_open(syntax.open, text, pos))
                pieces.append(text[pos:end])
                pos = end
                break
            pieces.append(text[pos:i])
            if (m := syntax.block.match(text, i)) is not None:
                calls.extend(parsed.call for parsed in syntax.calls(m, self.tools))
                pos = m.end()
            elif not final and syntax.may_start(text, i):
                pos = i
                break
            else:  # no block starts here: the opening is text (blocks cannot overlap the opening itself)
                pieces.append(syntax.open)
                pos = i + len(syntax.open)
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
