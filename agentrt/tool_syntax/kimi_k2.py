"""Kimi K2: a section of calls, ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>ID
<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. The model writes each
call's id as ``functions.NAME:INDEX`` (its index counting the conversation's calls) and the chat template writes it
back, also into the tool result (``## Return of ID``), so the call keeps the model's id as its own (history
written back in this syntax gives a call of another form of id one of the model's form). No grammar:
the index is the model's to count, which a literal call opening cannot."""

from __future__ import annotations

import json
import re
from typing import Any

from agentrt.tool_syntax.base import arguments_of
from agentrt.tool_syntax.section import SectionSyntax

_MODEL_ID = re.compile(r"functions\.[^:<]+:\d+")


def name_of(call_id: str) -> str:
    """The function a call id names (``functions.NAME:INDEX``; another id is the name itself)."""
    name = call_id.removeprefix("functions.")
    return name.rsplit(":", 1)[0] if ":" in name else name


class KimiK2(SectionSyntax):
    name = "kimi_k2"
    open = "<|tool_calls_section_begin|>"
    close = "<|tool_calls_section_end|>"
    markup = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
              "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    block = re.compile(r"<\|tool_calls_section_begin\|>\s*(.*?)<\|tool_calls_section_end\|>", re.S)
    call = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
                      re.S)
    grammar = None

    def call_parts(self, match: re.Match[str]) -> tuple[str, str | None, int]:
        return name_of(match.group(1)), match.group(1), 2

    def spell_call(self, index: int, call: dict[str, Any]) -> str:
        call_id = call.get("id") or ""
        if not _MODEL_ID.fullmatch(call_id):  # another server's id would read as the function's name
            call_id = "functions.{}:{}".format(call["function"]["name"], index)
        arguments = json.dumps(arguments_of(call), ensure_ascii=False)
        return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"
