"""The grammar a reply must match (engine.structured_output.StructuredSpec) for OpenAI's ``response_format`` and
``tool_choice`` over the request's tools: chat completions (agentrt.completions) and chain turns
(agentrt.turn_sampling) ask for one the same way (docs/structured-outputs.md). The engine masks every token that
would leave it, so the JSON parses and the tool calls parse and follow their tools' parameters.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentrt.errors import bad_field
from agentrt.tool_syntax import ToolSyntax
from engine.structured_output import StructuredSpec, schema_error
from sdk.schema import JsonObjectFormat, NamedToolChoice, ResponseFormat, TextFormat


def structured_spec(response_format: Any, tool_choice: Any, tools: list[dict[str, Any]] | None,
                    parallel_tool_calls: bool | None, syntax: ToolSyntax, prefix: str = "",
                    tools_key: str | None = None) -> tuple[StructuredSpec | None, str]:
    """The grammar a reply must match (None: free text) and the request field it comes from, for OpenAI's
    ``response_format`` and ``tool_choice`` over ``tools`` (OpenAI's tool dicts), calls spelled in the model's
    ``syntax``; a 400 naming the field when one is malformed or cannot be followed. ``prefix``: the fields' path
    (``sampling.`` in a chain turn);
    ``tools_key``: the field named for a tool whose parameters cannot be followed (default
    ``tools[i].function.parameters``).

    ``"required"``: one or more calls of the tools and nothing else (one with ``parallel_tool_calls`` false), each
    call's arguments following its tool's parameters; a named function: one call of it. ``"auto"`` (or none
    given) with tools: where some tool is ``strict``, free text in which every call that starts is a whole call
    of a tool (a strict tool's arguments follow its parameters, another's are any JSON object); with a JSON
    ``response_format`` too, the reply is that JSON or calls. ``"none"`` or no tools: ``response_format`` alone.
    """
    rf_key, tc_key = prefix + "response_format", prefix + "tool_choice"
    content = _content_schema(response_format, rf_key)
    mode, name = _tool_choice(tool_choice, tc_key)
    functions = [(i, t["function"]) for i, t in enumerate(tools or [])]
    one = parallel_tool_calls is False
    if mode in ("required", "function"):
        if not functions:
            raise bad_field(tc_key, f"{tool_choice!r} needs `tools`", "invalid_value")
        if mode == "function":
            functions = [(i, f) for i, f in functions if f["name"] == name]
            if not functions:
                raise bad_field(tc_key, f"names the function {name!r}, which is not among the tools", "invalid_value")
        _check_parameters(functions, tools_key)
        grammar = _grammar(syntax, tc_key, f"{tool_choice!r} forces calls")
        calls = [(f["name"], f.get("parameters")) for _, f in functions]
        return StructuredSpec.tool_calls(calls, required=True, max_calls=1 if one or mode == "function" else None,
                                         **grammar), tc_key
    strict = [(i, f) for i, f in functions if f.get("strict")]
    if mode == "none" or not functions or (not strict and content is None):
        if content is None:
            return None, rf_key
        return (StructuredSpec.json_object() if content == {"type": "object"} else
                StructuredSpec.json_schema(content)), rf_key
    _check_parameters(strict, tools_key)
    if strict:
        grammar = _grammar(syntax, tools_key or f"tools[{strict[0][0]}].function.strict",
                           "a strict tool constrains its calls")
    else:
        grammar = _grammar(syntax, rf_key, "a JSON response_format beside tools constrains the calls too")
    calls = [(f["name"], f.get("parameters") if f.get("strict") else None) for _, f in functions]
    return StructuredSpec.tool_calls(calls, required=False, content=content, max_calls=1 if one else None,
                                     **grammar), tc_key


def _grammar(syntax: ToolSyntax, key: str, what: str) -> dict[str, str]:
    if syntax.grammar is None:
        raise bad_field(key, f"{what}, which this model's tool-call syntax ({syntax.name}) cannot be made to follow",
                        "unsupported_value")
    return syntax.grammar


def _content_schema(response_format: Any, key: str) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks the reply to follow (None: free text)."""
    if response_format is None:
        return None
    try:
        fmt = msgspec.convert(response_format, ResponseFormat)
    except msgspec.ValidationError as exc:
        raise bad_field(key, f"{_where(exc, key)} (the formats: text, json_object, json_schema)",
                        "invalid_value") from None
    if isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat) or fmt.json_schema.schema is None:
        return {"type": "object"}
    if (why := schema_error(fmt.json_schema.schema)) is not None:
        raise bad_field(key, f"json_schema.schema cannot be followed: {why}", "invalid_value")
    return fmt.json_schema.schema


def _tool_choice(choice: Any, key: str) -> tuple[str | None, str | None]:
    """(mode, function name): mode None (not given), "auto", "none", "required" or "function"."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, str):
        raise bad_field(key, f"must be 'auto', 'none', 'required' or a function, not {choice!r}", "invalid_value")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise bad_field(key, "'allowed_tools' is not supported: send only the allowed tools, with 'auto' or "
                             "'required'", "unsupported_value")
    try:
        named = msgspec.convert(choice, NamedToolChoice)
    except msgspec.ValidationError as exc:
        raise bad_field(key, f'a function is {{"type": "function", "function": {{"name": ...}}}}: '
                             f"{_where(exc, key)}", "invalid_value") from None
    return "function", named.function.name


def _where(exc: msgspec.ValidationError, key: str) -> str:
    """msgspec's message with its path from ``key`` (and no backquotes, so the error stays on ``key``)."""
    return str(exc).replace("`$", f"`{key}").replace("`", "")


def _check_parameters(functions: list[tuple[int, dict[str, Any]]], tools_key: str | None) -> None:
    for i, f in functions:
        parameters = f.get("parameters")
        if parameters is not None and (why := schema_error(parameters)) is not None:
            key = tools_key or f"tools[{i}].function.parameters"
            raise bad_field(key, f"the parameters of {f['name']!r} cannot be followed: {why}", "invalid_value")
