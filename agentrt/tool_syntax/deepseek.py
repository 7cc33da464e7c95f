"""DeepSeek-V3 / V3.1 / V3.2 (and R1): a section of calls, ``<｜tool▁calls▁begin｜>`` then per call
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``; the
arguments one JSON object. The V3-0324 form, ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
arguments fenced as a JSON code block, reads the same. The chat template concatenates the arguments' JSON
text."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrt.tool_syntax.base import ParsedCall, Tools, ToolSyntax, arguments_of, joined, new_call

_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n<]+)\n```json\n(.*?)\n```"
                   r"|(.*?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>\s*", re.S)


class DeepSeek(ToolSyntax):
    name = "deepseek"
    open = "<｜tool▁calls▁begin｜>"
    close = "<｜tool▁calls▁end｜>"
    markup = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>")
    block = re.compile(r"<｜tool▁calls▁begin｜>\s*(.*?)<｜tool▁calls▁end｜>", re.S)
    grammar: ClassVar[dict[str, str]] = {
        "open": "<｜tool▁calls▁begin｜>", "close": "<｜tool▁calls▁end｜>", "trigger": "<｜tool▁calls▁begin｜>",
        "begin": "<｜tool▁call▁begin｜>{bare_name}<｜tool▁sep｜>", "end": "<｜tool▁call▁end｜>", "separator": ""}

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        body, base, pos, found = match.group(1), match.start(1), 0, []
        while pos < len(body):
            call = _CALL.match(body, pos)
            if call is None:
                return []
            fenced = call.group(1) is not None
            name, group = (call.group(1), 2) if fenced else (call.group(3), 4)
            try:
                arguments = json.loads(call.group(group))
            except json.JSONDecodeError:
                return []
            if not isinstance(arguments, dict) or not name.strip():
                return []
            found.append(ParsedCall(new_call(name.strip(), arguments),
                                    (base + call.start(group), base + call.end(group))))
            pos = call.end()
        return found

    def may_start(self, text: str, at: int) -> bool:
        return True  # the section's opening is a token of its own: what follows it is calls

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        if not calls:
            return content
        blocks = [f"<｜tool▁call▁begin｜>{call['function']['name']}<｜tool▁sep｜>"
                  f"{json.dumps(arguments_of(call), ensure_ascii=False)}<｜tool▁call▁end｜>" for call in calls]
        return joined(content, "", ["<｜tool▁calls▁begin｜>", *blocks, "<｜tool▁calls▁end｜>"])
