"""Qwen3-Coder, Qwen3.5 / 3.6: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
</tool_call>``, each part on its own line as the chat template writes it (a value's first and last newline are
the markup's). A value is bare text where it is a string and JSON (or Python's ``True`` / ``False``) otherwise:
the tools' schemas say which (``argument_value``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrt.tool_syntax.base import (ParsedCall, Tools, ToolSyntax, arguments_of, bare, joined,
                                      parameter_call)

_FUNCTION = "<function="
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3Coder(ToolSyntax):
    name = "qwen3_coder"
    open = "<tool_call>"
    close = "</tool_call>"
    markup = ("<tool_call>", "</tool_call>")
    block = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)</function>\s*</tool_call>", re.S)
    template_mapping = True  # the template iterates ``arguments | items``
    grammar: ClassVar[dict[str, str]] = {
        "begin": "<tool_call>\n<function={bare_name}>\n", "end": "</function>\n</tool_call>", "separator": "\n",
        "trigger": "<tool_call>", "parameter_begin": "<parameter={key}>\n", "parameter_end": "\n</parameter>\n"}

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        return parameter_call(match.group(1).strip(), match.group(2), 0, match.start(2), _PARAMETER, tools)

    def may_start(self, text: str, at: int) -> bool:
        rest = text[at + len(self.open):].lstrip()
        return rest.startswith(_FUNCTION) or _FUNCTION.startswith(rest)

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        blocks = []
        for i, call in enumerate(calls):
            arguments = arguments_of(call)
            parameters = "".join(f"<parameter={k}>\n{bare(v)}\n</parameter>\n"
                                 for k, v in (arguments.items() if isinstance(arguments, dict) else []))
            blocks.append(("\n" if i else "") +
                          f"<tool_call>\n<function={call['function']['name']}>\n{parameters}</function>\n</tool_call>")
        return joined(content.strip(), "\n\n", blocks)
