"""A conversation's items (agentrt.conversations): their ids, the form in which the conversation lists them, items
as the chain routes' messages, and a chain turn's output as items.

A conversation ``conv_<hex>`` is the chain ``chain_<hex>`` (the same 32 hex digits). An item holds what the
Responses API reads (agentrt.responses_types): a user message a ``message`` item, a tool message a
``function_call_output``, and a turn's output as the response returned it (a ``reasoning`` item, a ``message``, one
``function_call`` per call). ``reasoning`` items given by a client are skipped: the chain holds the reasoning as
generated.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentrt.chat import Message
from agentrt.errors import bad_field
from agentrt.reasoning import split_reasoning
from agentrt.responses_types import (FunctionCallItem, FunctionCallOutputItem, InputItem, OutputFunctionCall,
                                     OutputMessage, OutputReasoning, OutputText, OutputTextPart, ReasoningItem,
                                     ReasoningTextPart)
from agentrt.tool_syntax import ToolCallReader
from sdk.schema import TurnMessage

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_HEX = re.compile(r"[0-9a-f]{32}")


# --- ids ----------------------------------------------------------------------------------------------------
def chain_id_of(conversation_id: str) -> str | None:
    hex_ = conversation_id.removeprefix("conv_")
    return f"chain_{hex_}" if conversation_id.startswith("conv_") and _HEX.fullmatch(hex_) else None


def conversation_id_of(chain_id: str) -> str:
    return f"conv_{chain_id.removeprefix('chain_')}"


def new_item_id(item: InputItem) -> str:
    """A new id for an item a client gave (``fc_``, ``fco_`` or ``msg_`` and 32 hex digits)."""
    prefix = "fc" if isinstance(item, FunctionCallItem) else "fco" if isinstance(item, FunctionCallOutputItem) \
        else "msg"
    return f"{prefix}_{uuid.uuid4().hex}"


def output_ids(key: str) -> tuple[str, str]:
    """The ids of a response turn's reasoning and message items (its calls': ``call_item_id``)."""
    return f"rs_{key}", f"msg_{key}"


def call_item_id(key: str, j: int) -> str:
    return f"fc_{key}_{j}"


def digest(messages: Sequence[Message]) -> str:
    """What identifies a turn's messages (user and tool messages: role, content, call id)."""
    rows = [[m["role"], m["content"], m.get("tool_call_id")] for m in messages]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()[:24]


# --- items --------------------------------------------------------------------------------------------------
def content_text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def message_item(item_id: str, role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return msgspec.to_builtins(OutputMessage(id=item_id, content=[OutputTextPart(text=text)]))
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return msgspec.to_builtins(OutputFunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments))


def call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call_output", "call_id": call_id, "output": output,
            "status": "completed"}


def parse_item(raw: dict[str, Any], key: str) -> InputItem:
    """An input item as the Responses route reads one (400 naming ``key`` or its field)."""
    kind = raw.get("type", "message")
    if kind not in ITEM_TYPES:
        raise bad_field(f"{key}.type", f"{kind!r} is not an item this server takes (one of {', '.join(ITEM_TYPES)})")
    try:
        return msgspec.convert({"type": "message", **raw}, InputItem)
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


def stored_item(item: InputItem, key: str, item_id: str) -> dict[str, Any] | None:
    """``item`` as the conversation lists it, with ``item_id`` (None: a ``reasoning`` item, which is skipped: the
    chain holds the reasoning as generated)."""
    if isinstance(item, ReasoningItem):
        return None
    if isinstance(item, FunctionCallItem):
        return call_item(item_id, item.call_id, item.name, item.arguments)
    if isinstance(item, FunctionCallOutputItem):
        message = {"role": "tool", "content": content_text(item.output), "tool_call_id": item.call_id}
        _check_message(message, key)
        return call_output_item(item_id, item.call_id, message["content"])
    if item.role != "assistant" and not isinstance(item.content, str) \
            and any(isinstance(p, OutputText) for p in item.content):
        raise bad_field(f"{key}.content", f"a {item.role} message takes input_text parts")
    if item.role == "user":
        _check_message({"role": "user", "content": content_text(item.content)}, key)
    return message_item(item_id, item.role, content_text(item.content))


def _check_message(message: Message, key: str) -> None:
    try:
        msgspec.convert(message, TurnMessage)  # the turn's limits, named here
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


def item_text(item: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in item.get("content") or [])


@dataclass(slots=True)
class History:
    """Items (as stored) as the chain routes' messages: consecutive assistant ``message`` / ``function_call``
    items are one assistant message; per message the ids of its items and the field to name in an error."""

    messages: list[Message] = field(default_factory=list)
    ids: list[list[str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    calls: list[list[tuple[str, str]]] = field(default_factory=list)  # an assistant message's (item id, call id)


def history(items: Sequence[tuple[dict[str, Any], str]]) -> History:
    out = History()
    called: dict[str, str] = {}  # call id -> name, of the function_call items among ``items``
    for item, name in items:
        assistant = item["type"] == "function_call" or (item["type"] == "message" and item["role"] == "assistant")
        if assistant:
            if not out.messages or out.messages[-1]["role"] != "assistant":
                out.messages.append({"role": "assistant", "content": ""})
                out.ids.append([])
                out.names.append(name)
                out.calls.append([])
            message = out.messages[-1]
            if item["type"] == "function_call":
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
                called[item["call_id"]] = item["name"]
                out.calls[-1].append((item["id"], item["call_id"]))
            else:
                message["content"] += item_text(item)
            out.ids[-1].append(item["id"])
            continue
        if item["type"] == "function_call_output":
            message = {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
            if item["call_id"] in called:
                message["name"] = called[item["call_id"]]
        elif item["role"] in ("system", "developer"):
            raise bad_field(f"{name}.role", "system and developer messages may only open a conversation (in "
                                            "`items` of POST /v1/conversations): the chain's system prompt is fixed")
        else:
            message = {"role": "user", "content": item_text(item)}
        out.messages.append(message)
        out.ids.append([item["id"]])
        out.names.append(name)
        out.calls.append([])
    return out


def check_order(hist: History) -> None:
    """An assistant message must follow a user message or tool results (the conversation's chain ends with the
    assistant's turn)."""
    for i, message in enumerate(hist.messages):
        if message["role"] == "assistant" and (i == 0 or hist.messages[i - 1]["role"] == "assistant"):
            raise bad_field(hist.names[i], "an assistant item must follow a user message or function_call_output "
                                           "(the conversation's last turn is the assistant's)")


def check_pending(items: list[tuple[dict[str, Any], str]]) -> None:
    if items:
        check_order(history(items))


def turn_output(content: str, tool_calls: list[dict[str, Any]], thinking: bool | None, reader: ToolCallReader | None,
                rs_id: str, msg_id: str, call_ids: Any) -> list[dict[str, Any]]:
    """A chain turn's output as the response returned it (agentrt.responses: a ``reasoning`` item, a ``message``
    without the tool-call markup, a ``function_call`` per call; ``reader`` None: the text as generated, no
    calls). ``call_ids(j)``: (item id, call id or None: the
    chain's) of the j-th call."""
    thought, text = "", content
    if thinking is not None:
        thought, text = split_reasoning(text, thinking)
    calls: list[dict[str, Any]] = []
    if reader is not None:
        calls = tool_calls[len(tool_calls) - min(len(reader.calls_in(text)), len(tool_calls)):]
        text = reader.without_calls(text)
    out: list[dict[str, Any]] = []
    if thought:
        out.append(msgspec.to_builtins(OutputReasoning(id=rs_id, content=[ReasoningTextPart(text=thought)])))
    if text:
        out.append(message_item(msg_id, "assistant", text))
    for j, c in enumerate(calls):
        item_id, call_id = call_ids(j)
        out.append(call_item(item_id, call_id or c["id"], c["function"]["name"], c["function"]["arguments"]))
    return out
