"""Kimi K2: a section of calls, ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>ID
<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. The model writes each
call's id as ``functions.NAME:INDEX`` (its index counting the conversation's calls) and the chat template writes it
back, also into the tool result (``## Return of ID``), so the call keeps the model's id as its own (history
written back in this syntax gives a call of another form of id one of the model's form). No grammar:
the index is the model's to count, which a literal call opening cannot."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax, arguments_of, joined, new_call

_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
                   re.S)
_MODEL_ID = re.compile(r"functions\.[^:<]+:\d+")


def name_of(call_id: str) -> str:
    """The function a call id names (``functions.NAME:INDEX``; another id is the name itself)."""
    name = call_id.removeprefix("functions.")
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiK2(ToolSyntax):
    name = "kimi_k2"
    open = "<|tool_calls_section_begin|>"
    close = "<|tool_calls_section_end|>"
    markup = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
              "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    block = re.compile(r"<\|tool_calls_section_begin\|>\s*(.*?)<\|tool_calls_section_end\|>", re.S)
    grammar = None

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        body, base, pos, found = match.group(1), match.start(1), 0, []
        while pos < len(body):
            call = _CALL.match(body, pos)
            if call is None:
                return []
            try:
                arguments = json.loads(call.group(2))
            except json.JSONDecodeError:
                return []
            call_id = call.group(1)
            if not isinstance(arguments, dict) or not name_of(call_id):
                return []
            found.append(ParsedCall(new_call(name_of(call_id), arguments, call_id),
                                    (base + call.start(2), base + call.end(2))))
            pos = call.end()
        return found

    def may_start(self, text: str, at: int) -> bool:
        return True  # the section's opening is a token of its own: what follows it is calls

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        if not calls:
            return content
        blocks = []
        for i, call in enumerate(calls):
            call_id = call.get("id") or ""
            if not _MODEL_ID.fullmatch(call_id):  # another server's id would read as the function's name
                call_id = "functions.{}:{}".format(call["function"]["name"], i)
            arguments = json.dumps(arguments_of(call), ensure_ascii=False)
            blocks.append(f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>")
        return joined(content, "", [self.open, *blocks, self.close])
