"""Hermes / Qwen (Qwen2.5, Qwen3, Qwen3-Next, the embedded model): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one JSON object a block. The tag followed by anything but ``{`` is text."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax, arguments_of, joined, new_call
from agentrt.tool_syntax.json_members import member_span

_MAY_START = re.compile(r"<tool_call>\s*(?:\{|\Z)")


class Hermes(ToolSyntax):
    name = "hermes"
    open = "<tool_call>"
    close = "</tool_call>"
    # the opening tag, a JSON object (up to the first `}` that the closing tag follows), the closing tag
    markup = ("<tool_call>", "</tool_call>")
    block = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
    grammar: ClassVar[dict[str, str]] = {}  # StructuredSpec.tool_calls' defaults are this syntax

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        body = match.group(1)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        span = member_span(body, "arguments")
        where = None if span is None else (match.start(1) + span[0], match.start(1) + span[1])
        return [ParsedCall(new_call(obj["name"], obj.get("arguments", {})), where)]

    def may_start(self, text: str, at: int) -> bool:
        return _MAY_START.match(text, at) is not None

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        blocks = []
        for i, call in enumerate(calls):
            name = json.dumps(call["function"]["name"], ensure_ascii=False)
            arguments = json.dumps(arguments_of(call), ensure_ascii=False)
            block = f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'
            blocks.append(("\n" if i else "") + block)
        return joined(content, "\n", blocks)
