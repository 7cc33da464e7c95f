"""GLM-4.5 / 4.6 / 4.7 (GLM-4.7-Flash): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
</tool_call>`` (newlines between the parts as the chat template writes them). A value is bare text where it is
a string and JSON otherwise: the tools' schemas say which (``argument_value``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax, arguments_of, bare, parameter_call

_MAY_START = re.compile(r"<tool_call>\s*(?:[^\s<]|\Z)")
_NAME = re.compile(r"\s*([^\s<][^<]*?)\s*(?=<arg_key>|\Z)", re.S)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45(ToolSyntax):
    name = "glm45"
    open = "<tool_call>"
    close = "</tool_call>"
    markup = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    block = re.compile(r"<tool_call>(?=\s*[^\s<])(.*?)</tool_call>", re.S)
    template_mapping = True  # the template iterates ``arguments.items()``
    grammar: ClassVar[dict[str, str]] = {
        "begin": "<tool_call>{bare_name}\n", "end": "</tool_call>", "separator": "\n", "trigger": "<tool_call>",
        "parameter_begin": "<arg_key>{key}</arg_key>\n<arg_value>", "parameter_end": "</arg_value>\n"}

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        body, base = match.group(1), match.start(1)
        head = _NAME.match(body)
        if head is None:
            return []
        return parameter_call(head.group(1), body, head.end(), base, _PAIR, tools)

    def may_start(self, text: str, at: int) -> bool:
        return _MAY_START.match(text, at) is not None

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        blocks = []
        for call in calls:
            arguments = arguments_of(call)
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{bare(v)}</arg_value>\n"
                            for k, v in (arguments.items() if isinstance(arguments, dict) else []))
            blocks.append(f"\n<tool_call>{call['function']['name']}\n{pairs}</tool_call>")
        return (content.strip() + "".join(blocks)).removeprefix("\n")  # each block opens on a line of its own
