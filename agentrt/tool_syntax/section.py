"""Syntaxes whose calls sit in a section of their own (DeepSeek's, Kimi K2's): the section's opening and closing
are tokens, and each call in it is one match of the syntax's call pattern with JSON-object arguments. A subclass
says how a call's match names the function (and its id) and where its arguments are, and how one call is
written; reading, streaming and writing the section are shared."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax, joined, new_call


class SectionSyntax(ToolSyntax):
    call: ClassVar[re.Pattern[str]]  # one call in the section, trailing whitespace included

    def call_parts(self, match: re.Match[str]) -> tuple[str, str | None, int]:
        """(the function's name, the call's id or None for a new one, the group that holds the arguments)."""
        raise NotImplementedError

    def spell_call(self, index: int, call: dict[str, Any]) -> str:
        """One call of the section as the model writes it (``call``: an OpenAI tool-call dict)."""
        raise NotImplementedError

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        body, base, pos, found = match.group(1), match.start(1), 0, []
        while pos < len(body):
            call = self.call.match(body, pos)
            if call is None:
                return []
            name, call_id, group = self.call_parts(call)
            try:
                arguments = json.loads(call.group(group))
            except json.JSONDecodeError:
                return []
            if not isinstance(arguments, dict) or not name:
                return []
            found.append(ParsedCall(new_call(name, arguments, call_id),
                                    (base + call.start(group), base + call.end(group))))
            pos = call.end()
        return found

    def may_start(self, text: str, at: int) -> bool:
        return True  # the section's opening is a token of its own: what follows it is calls

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        if not calls:
            return content
        return joined(content, "", [self.open, *(self.spell_call(i, c) for i, c in enumerate(calls)), self.close])
