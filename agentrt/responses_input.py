"""The Responses API request in the chain routes' terms (agentrt.responses): its input items as turn messages, its
tools, its sampling. Each check is a 400 naming the field (``bad_field``), raised before any chain is touched.

Without ``previous_response_id`` (nor ``conversation``) the items are a whole conversation (``whole_conversation``);
with it they are one more turn of the chain (``continued_messages``), where assistant items may only echo the
previous response's output: the chain already holds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from agentrt.chat import Message
from agentrt.errors import bad_field
from agentrt.responses_types import (FunctionCallItem, FunctionCallOutputItem, FunctionTool, InputItem, MessageItem,
                                     OutputFunctionCall, OutputMessage, OutputText, ReasoningItem, ResponseObject,
                                     ResponsesRequest, ToolChoiceFunction)
from engine.structured_output import schema_error
from sdk.schema import TurnCreate, TurnMessage

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def text_of(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


@dataclass(slots=True)
class Conversation:
    """A request without ``previous_response_id`` as a whole conversation: the chain routes' messages."""

    system: str | None  # instructions and the leading system / developer items; None: the server's default
    messages: list[Message]
    names: list[str]  # the input field of each message (an assistant message's: its first item), for errors


def convert(value: Any, kind: Any, key: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


def request_items(req: ResponsesRequest) -> list[InputItem]:
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    if not req.input:
        raise bad_field("input", "must hold at least one item")
    items = []
    for i, raw in enumerate(req.input):
        kind = raw.get("type", "message")
        if kind not in ITEM_TYPES:
            raise bad_field(f"input[{i}].type", f"{kind!r} is not an input item this server takes (one of "
                                                f"{', '.join(ITEM_TYPES)})")
        items.append(convert({"type": "message", **raw}, InputItem, f"input[{i}]"))
    return items


def request_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The chain routes' form of the request's tools (None when left out)."""
    if req.tools is None:
        return None
    tools = []
    for i, raw in enumerate(req.tools):
        if raw.get("type") != "function":
            raise bad_field(f"tools[{i}].type", f"only function tools, not {raw.get('type')!r}")
        t = convert(raw, FunctionTool, f"tools[{i}]")
        function = {"name": t.name, **({"description": t.description} if t.description else {}),
                    **({"parameters": t.parameters} if t.parameters is not None else {})}
        tools.append({"type": "function", "function": function})
    return tools


def max_output_tokens(req: ResponsesRequest, per_turn: int) -> int:
    """``max_output_tokens`` within the server's per-turn limit (a larger one is lowered to it, and by the
    engine to what the context holds: the response is then incomplete, ``max_output_tokens``)."""
    return min(req.max_output_tokens or per_turn, per_turn)


def request_sampling(req: ResponsesRequest, tools: list[dict[str, Any]],
                     max_tokens: int) -> tuple[dict[str, Any], bool]:
    greedy = req.top_p == 0
    sampling: dict[str, Any] = {
        "temperature": 0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None or greedy else req.top_p,
        "max_tokens": max_tokens, "fit_max_tokens": True}
    if req.forced_token_ids:
        sampling["forced_token_ids"] = list(req.forced_token_ids)
    choice = req.tool_choice
    if choice in ("required",) or isinstance(choice, ToolChoiceFunction):
        if not tools:
            raise bad_field("tool_choice", "forces a tool call, which needs `tools`")
        named = [t for t in tools if not isinstance(choice, ToolChoiceFunction)
                 or t["function"]["name"] == choice.name]
        if not named:
            raise bad_field("tool_choice.name", f"names the tool {choice.name!r}, which is not among the tools")
        for i, t in enumerate(tools):
            if t in named and (why := schema_error(t["function"].get("parameters") or {"type": "object"})):
                raise bad_field(f"tools[{i}].parameters", f"cannot be followed when tool_choice forces a call: "
                                                          f"{why}")
        sampling["tool_choice"] = "required" if choice == "required" else \
            {"type": "function", "function": {"name": choice.name}}
        if req.parallel_tool_calls is not None:
            sampling["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.__struct_config__.tag == "json_schema":
        if (why := schema_error(fmt.schema)) is not None:
            raise bad_field("text.format.schema", f"cannot be followed: {why}")
        sampling["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema, "description": fmt.description, "strict": fmt.strict}}
    elif fmt is not None and fmt.__struct_config__.tag == "json_object":
        sampling["response_format"] = {"type": "json_object"}
    return sampling, choice != "none"


def whole_conversation(req: ResponsesRequest, items: list[InputItem]) -> Conversation:
    """The items of a request without ``previous_response_id`` as a whole conversation (agentrt.responses): a
    400 naming the item where one cannot be part of it."""
    system_parts = [req.instructions] if req.instructions is not None else []
    start = 0
    while start < len(items) and isinstance(items[start], MessageItem) and \
            items[start].role in ("system", "developer"):
        system_parts.append(text_of(items[start].content))
        start += 1
    messages: list[Message] = []
    names: list[str] = []
    called: dict[str, str] = {}  # call id -> function name, of the function_call items so far
    for i, item in enumerate(items[start:], start):
        key = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            continue  # the chain holds the reasoning as generated; history from elsewhere drops it
        if isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant"):
            if not messages or messages[-1]["role"] != "assistant":  # consecutive items: one message
                messages.append({"role": "assistant", "content": ""})
                names.append(key)
            if isinstance(item, FunctionCallItem):
                messages[-1].setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}})
                called[item.call_id] = item.name
            else:
                messages[-1]["content"] += text_of(item.content)
            continue
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise bad_field(f"{key}.call_id", f"no function_call item with the call_id {item.call_id!r} "
                                                  "precedes it in the input")
            message: Message = {"role": "tool", "content": text_of(item.output), "tool_call_id": item.call_id,
                                "name": called[item.call_id]}
        elif item.role in ("system", "developer"):
            raise bad_field(f"{key}.role", "system and developer messages may only open the conversation "
                                           "(they become the chain's system prompt with `instructions`)")
        else:
            if not isinstance(item.content, str) and any(isinstance(p, OutputText) for p in item.content):
                raise bad_field(f"{key}.content", "a user message takes input_text parts")
            message = {"role": "user", "content": text_of(item.content)}
        convert(message, TurnMessage, key)  # the turn's limits, named here
        messages.append(message)
        names.append(key)
    if not any(m["role"] != "assistant" for m in messages):
        raise bad_field("input", "must hold a user message or a function_call_output")
    if messages[-1]["role"] == "assistant":
        raise bad_field("input", "must end with a user message or function_call_output items: the response "
                                 "follows them")
    if messages[0]["role"] == "assistant":
        raise bad_field(names[0], "the conversation must open with a user message, not the assistant's")
    return Conversation(system="\n".join(system_parts) if system_parts else None, messages=messages,
                        names=names)


def turn_create(req: ResponsesRequest, messages: list[Message], sampling: dict[str, Any]) -> TurnCreate:
    return convert({"messages": messages, "sampling": sampling, "stream": bool(req.stream),
                    "hints": None if req.session_hints is None else msgspec.to_builtins(req.session_hints)},
                   TurnCreate, "input")


def continued_messages(items: list[InputItem], start: int,
                       previous: ResponseObject | None) -> list[dict[str, Any]]:
    """The turn's messages after ``previous`` (the previous response, None when not committed)."""
    echoed = set()
    if previous is not None:
        echoed = {o.call_id for o in previous.output if isinstance(o, OutputFunctionCall)}
        echoed |= {o.id for o in previous.output if isinstance(o, OutputMessage)}
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items[start:], start):
        key = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            continue  # an echoed think block: the chain holds the reasoning as generated
        if isinstance(item, FunctionCallItem):
            if item.call_id not in echoed:
                raise bad_field(f"{key}.call_id", "a function_call item must echo a call of the previous "
                                                  "response's output (the chain holds the conversation)")
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": text_of(item.output), "tool_call_id": item.call_id})
        elif item.role == "assistant":
            if item.id is None or item.id not in echoed:
                raise bad_field(f"{key}.role", "an assistant message must echo the previous response's "
                                               "output (the chain holds the conversation)")
        elif item.role in ("system", "developer"):
            raise bad_field(f"{key}.role", "system and developer messages may only open a new conversation "
                                           "(they become the chain's system prompt with `instructions`); "
                                           "with previous_response_id the chain's is fixed")
        else:
            if not isinstance(item.content, str) and any(isinstance(p, OutputText) for p in item.content):
                raise bad_field(f"{key}.content", "a user message takes input_text parts")
            messages.append({"role": "user", "content": text_of(item.content)})
    if not messages:
        raise bad_field("input", "must hold a user message or a function_call_output")
    return messages


def conversation_id(req: ResponsesRequest) -> str | None:
    c = req.conversation
    return c if c is None or isinstance(c, str) else c.id


def effort(req: ResponsesRequest) -> str | None:
    effort = (req.reasoning or {}).get("effort")
    return effort if effort is None or isinstance(effort, str) else str(effort)


def thinking(req: ResponsesRequest) -> bool | None:
    """The chat template's ``enable_thinking`` (None: the template's default)."""
    level = effort(req)
    return None if level is None else level != "none"
