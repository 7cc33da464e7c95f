"""What every tool-call syntax shares: a syntax finds whole blocks of calls in a reply's text; content, calls,
their argument spans and the streamed form all follow from that one rule.

A syntax (one file each in this package) names the text that opens a block (``open``), a pattern for a whole
block (``block``), how a block's match yields its calls (``calls``: one, or several for a syntax whose block
wraps a list of calls) and whether more text could still complete a block that opens at a place
(``may_start``). A block's calls read each argument's value with the request's tool schemas where the syntax
spells arguments as text (``argument_value``). A block whose calls do not parse is still markup: the content
leaves it out and no call comes of it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sdk.schema import FunctionCall, ToolCall

Tools = Sequence[dict[str, Any]]  # OpenAI tool dicts: {"type": "function", "function": {"name", "parameters"}}


def new_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A call with its arguments as JSON text (text arguments are kept as they are)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=call_id or f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=text))


@dataclass(frozen=True, slots=True)
class ParsedCall:
    call: ToolCall
    arguments: tuple[int, int] | None  # where the arguments are spelled in the text (None: no arguments)


class ToolSyntax:
    name: ClassVar[str]
    open: ClassVar[str]  # the text a block starts with
    close: ClassVar[str]  # the text every block ends with
    markup: ClassVar[tuple[str, ...]]  # the tags a tokenizer may hold as tokens of their own
    block: ClassVar[re.Pattern[str]]  # a whole block, from ``open`` to its closing text
    # whether a call's arguments reach the chat template as a mapping (templates that iterate them) or as the
    # JSON text the API carries
    template_mapping: ClassVar[bool] = False
    # StructuredSpec.tool_calls' arguments that spell calls in this syntax (forced calls, strict tools); None:
    # calls of this syntax cannot be forced
    grammar: ClassVar[dict[str, str] | None]

    def calls(self, match: re.Match[str], tools: Tools) -> list[ParsedCall]:
        """The calls of a block; [] when it is malformed. Spans are offsets into ``match.string``."""
        raise NotImplementedError

    def may_start(self, text: str, at: int) -> bool:
        """Whether a block could still start at ``at`` (where ``open`` is) once more text follows."""
        raise NotImplementedError

    def spell(self, content: str, calls: Sequence[dict[str, Any]]) -> str:
        """An assistant message as the model generates it: ``content`` then ``calls`` (OpenAI tool-call dicts)
        in this syntax, joined as the chat template joins them."""
        raise NotImplementedError

    def template_arguments(self, arguments: Any) -> Any:
        """A call's arguments as the chat template takes them."""
        if not self.template_mapping or not isinstance(arguments, str):
            return arguments
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    def blocks(self, text: str) -> Iterator[re.Match[str]]:
        """The whole blocks of ``text`` in order, each searched from the end of the one before."""
        pos = 0
        while (i := text.find(self.open, pos)) >= 0:
            match = self.block.match(text, i)
            if match is None:
                pos = i + len(self.open)
                continue
            yield match
            pos = match.end()


def arguments_value(arguments: Any) -> Any:
    """A call's arguments as a value: JSON text decoded (text that is not JSON stays text)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def arguments_of(call: dict[str, Any]) -> Any:
    """An OpenAI tool-call dict's arguments as a value (none: an empty object)."""
    arguments = call["function"].get("arguments")
    return arguments_value(arguments) if arguments is not None else {}


def bare(value: Any) -> str:
    """A value as the XML-like syntaxes spell it: strings bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def joined(content: str, separator: str, blocks: Sequence[str]) -> str:
    """``content`` and the calls' ``blocks``, with ``separator`` between content and the first block."""
    if not blocks:
        return content
    return content + separator + "".join(blocks) if content else "".join(blocks)


_SPACE = re.compile(r"\s*")


def parameter_call(name: str, body: str, start: int, base: int, part: re.Pattern[str],
                   tools: Tools) -> list[ParsedCall]:
    """The call of ``name`` whose arguments are ``body[start:]``: parts matching ``part`` (group 1 a parameter's
    name, group 2 its bare value, ``argument_value`` typing it by the tools' schemas), whitespace between; [] when
    anything else is there. ``base``: where ``body`` starts in the text (for the arguments' span)."""
    pos, arguments, first, last = start, {}, None, None
    while pos < len(body):
        found = part.match(body, pos)
        if found is None:
            return []
        key = found.group(1).strip()
        arguments[key] = argument_value(found.group(2), parameter_schema(tools, name, key))
        first = found.start() if first is None else first
        last = found.end()
        pos = _SPACE.match(body, last).end()  # type: ignore[union-attr]
    return [ParsedCall(new_call(name, arguments), None if first is None else (base + first, base + last))]


def parameter_schema(tools: Tools, name: str, parameter: str) -> dict[str, Any] | None:
    """The JSON schema of tool ``name``'s ``parameter`` (None when the tools do not say)."""
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            schema = properties.get(parameter)
            return schema if isinstance(schema, dict) else None
    return None


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
               (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def argument_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A value a syntax spells as text (strings bare, other values as JSON): the JSON it spells where that is of
    a type the schema allows, else the text itself where the schema allows a string; with no schema, the JSON it
    spells or else the text. A boolean spelled as Python writes it (``True``) reads as one where the schema asks
    for a boolean."""
    types = (schema or {}).get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    if "number" in types:
        types.add("integer")
    if "boolean" in types and raw.strip() in ("True", "False"):
        return raw.strip() == "True"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if types and _json_type(value) not in types and "string" in types:
        return raw
    return value
