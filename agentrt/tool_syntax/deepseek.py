"""DeepSeek-V3 / V3.1 / V3.2 (and R1): a section of calls, ``<｜tool▁calls▁begin｜>`` then per call
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``; the
arguments one JSON object. The V3-0324 form, ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
arguments fenced as a JSON code block, reads the same. The chat template concatenates the arguments' JSON
text."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from agentrt.tool_syntax.base import arguments_of
from agentrt.tool_syntax.section import SectionSyntax


class DeepSeek(SectionSyntax):
    name = "deepseek"
    open = "<｜tool▁calls▁begin｜>"
    close = "<｜tool▁calls▁end｜>"
    markup = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>")
    block = re.compile(r"<｜tool▁calls▁begin｜>\s*(.*?)<｜tool▁calls▁end｜>", re.S)
    call = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n<]+)\n```json\n(.*?)\n```"
                      r"|(.*?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>\s*", re.S)
    grammar: ClassVar[dict[str, str]] = {
        "open": "<｜tool▁calls▁begin｜>", "close": "<｜tool▁calls▁end｜>", "trigger": "<｜tool▁calls▁begin｜>",
        "begin": "<｜tool▁call▁begin｜>{bare_name}<｜tool▁sep｜>", "end": "<｜tool▁call▁end｜>", "separator": ""}

    def call_parts(self, match: re.Match[str]) -> tuple[str, str | None, int]:
        if match.group(1) is not None:  # the fenced form
            return match.group(1).strip(), None, 2
        return match.group(3).strip(), None, 4

    def spell_call(self, index: int, call: dict[str, Any]) -> str:
        arguments = json.dumps(arguments_of(call), ensure_ascii=False)
        return f"<｜tool▁call▁begin｜>{call['function']['name']}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"
