"""The Messages API request in the chain routes' terms (agentrt.anthropic_messages): its conversation as turn
messages, its ``tool_choice`` as the turn's sampling, its ``thinking`` as the chat template's flag, its
``context_management`` edits. Each check is a 400 naming the field (``bad_field``), raised before any chain is
touched.

A user message's text blocks become one user message (joined by a newline), each ``tool_result`` a tool message
(its text blocks joined by a newline, ``Error: `` before the text when ``is_error``; ``name`` from the ``tool_use``
it answers), an assistant message its text (blocks joined) and its ``tool_use`` blocks as calls (consecutive
assistant messages are one, as Anthropic merges them); a final assistant message is the reply's prefix (the turn's
``assistant_prefix``; the reply holds only what follows it). Thinking blocks a client sends back in assistant
messages are skipped: the conversation's chain holds the reasoning as generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec

from agentrt.anthropic_types import (ClearThinkingEdit, ClearToolUsesEdit, CountTokensRequest, DocumentBlockParam,
                                     ImageBlockParam, MessagesRequest, RedactedThinkingBlockParam,
                                     SearchResultBlockParam, TextBlockParam, Thinking, ThinkingBlockParam,
                                     ThinkingDisabled, ThinkingEnabled, ToolChoice, ToolChoiceAny, ToolChoiceNone,
                                     ToolChoiceTool, ToolParam, ToolResultBlockParam, ToolUseBlockParam)
from agentrt.chat import Message as ChainMessage
from agentrt.errors import bad_field
from engine.structured_output import schema_error
from sdk.schema import FunctionDef, Tool


@dataclass(slots=True)
class Conversation:
    """A request's conversation as the chain routes take it."""

    system: str | None
    tools: list[dict[str, Any]]  # the chain routes' form
    messages: list[ChainMessage]  # without a final assistant message
    names: list[str]  # the request field of each message, for errors
    prefix: str | None  # a final assistant message's text: the reply continues it


def _refuse_block(block: Any, key: str, thinks: bool = False, assistant: bool = False) -> None:
    """``thinks``: the model thinks, so thinking blocks are taken in an ``assistant`` message."""
    if isinstance(block, (ImageBlockParam, DocumentBlockParam, SearchResultBlockParam)):
        kind = block.__struct_config__.tag
        raise bad_field(f"{key}.type", f"this model takes text only, not {kind!r} blocks")
    if isinstance(block, (ThinkingBlockParam, RedactedThinkingBlockParam)) and not (thinks and assistant):
        raise bad_field(f"{key}.type", "thinking blocks belong in assistant messages" if thinks else
                        "this server's model does not think and returns no thinking blocks: leave them out")


def _tool_result_text(block: ToolResultBlockParam, key: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts = []
        for k, part in enumerate(block.content):
            _refuse_block(part, f"{key}.content[{k}]")
            parts.append(cast(TextBlockParam, part).text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def enable_thinking(thinking: Thinking | None) -> bool | None:
    """The chat template's ``enable_thinking`` for a request's ``thinking`` (None: the template's default)."""
    if isinstance(thinking, ThinkingEnabled):
        return True
    if isinstance(thinking, ThinkingDisabled):
        return False
    return None


def conversation(req: MessagesRequest | CountTokensRequest, thinks: bool = False) -> Conversation:
    """``thinks``: the model thinks, so thinking blocks in assistant messages are taken (and skipped). The system
    prompt is ``system`` and the ``system`` messages that open the conversation, joined by a newline; a ``system``
    message after the first user or assistant message is a 400 naming it."""
    system = req.system if isinstance(req.system, str) or req.system is None else \
        "\n".join(b.text for b in req.system) if req.system else None
    opening = 0
    while opening < len(req.messages) and req.messages[opening].role == "system":
        m = req.messages[opening]
        blocks = [TextBlockParam(text=m.content)] if isinstance(m.content, str) else m.content
        for j, b in enumerate(blocks):
            if not isinstance(b, TextBlockParam):
                raise bad_field(f"messages[{opening}].content[{j}].type", "a system message holds text blocks only")
        text = "\n".join(b.text for b in blocks)
        system = text if system is None else f"{system}\n{text}"
        opening += 1
    # the chain routes' form, key order included: the chat template renders the tools as JSON in that order
    tools = msgspec.to_builtins([Tool(function=FunctionDef(name=t.name, description=t.description,
                                                           parameters=t.input_schema)) for t in req.tools or []])
    called = {b.id: b.name for m in req.messages if m.role == "assistant" and not isinstance(m.content, str)
              for b in m.content if isinstance(b, ToolUseBlockParam)}
    messages: list[ChainMessage] = []
    names: list[str] = []
    for i, m in enumerate(req.messages[opening:], opening):
        key = f"messages[{i}]"
        if m.role == "system":
            raise bad_field(f"{key}.role", "system messages may only open the conversation (the chat template "
                                           "renders one system prompt): put it in `system` or before the others")
        blocks = [TextBlockParam(text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            texts, calls = [], []
            for j, b in enumerate(blocks):
                _refuse_block(b, f"{key}.content[{j}]", thinks, assistant=True)
                if isinstance(b, ToolResultBlockParam):
                    raise bad_field(f"{key}.content[{j}].type", "tool_result blocks belong in user messages")
                if isinstance(b, (ThinkingBlockParam, RedactedThinkingBlockParam)):
                    continue  # the chain holds the reasoning as generated; history from elsewhere drops it
                if isinstance(b, TextBlockParam):
                    texts.append(b.text)
                else:
                    b = cast(ToolUseBlockParam, b)
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            if messages and messages[-1]["role"] == "assistant":  # consecutive assistant messages are one
                messages[-1]["content"] += "".join(texts)
                messages[-1].setdefault("tool_calls", []).extend(calls)
                continue
            message: ChainMessage = {"role": "assistant", "content": "".join(texts)}
            messages.append({**message, "tool_calls": calls} if calls else message)
            names.append(key)
            continue
        texts = []
        for j, b in enumerate(blocks):
            _refuse_block(b, f"{key}.content[{j}]", thinks)
            if isinstance(b, ToolUseBlockParam):
                raise bad_field(f"{key}.content[{j}].type", "tool_use blocks belong in assistant messages")
            if isinstance(b, TextBlockParam):
                texts.append(b.text)
                continue
            b = cast(ToolResultBlockParam, b)
            if b.tool_use_id not in called:
                raise bad_field(f"{key}.content[{j}].tool_use_id", f"no tool_use block with the id {b.tool_use_id!r} "
                                                                   "precedes it")
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
                names.append(key)
                texts = []
            messages.append({"role": "tool", "content": _tool_result_text(b, f"{key}.content[{j}]"),
                             "tool_call_id": b.tool_use_id, "name": called[b.tool_use_id]})
            names.append(f"{key}.content[{j}]")
        if texts or not blocks:
            messages.append({"role": "user", "content": "\n".join(texts)})
            names.append(key)
    prefix = None
    if messages and messages[-1]["role"] == "assistant":
        last = messages.pop()
        if last.get("tool_calls"):
            raise bad_field(names[-1], "a final assistant message (the start of the reply) may hold text only")
        if last["content"] != last["content"].rstrip():
            raise bad_field(names[-1], "a final assistant message (the start of the reply) cannot end with "
                                       "whitespace")
        prefix = last["content"] or None
        names.pop()
    return Conversation(system=system, tools=tools, messages=messages, names=names, prefix=prefix)


def check_tool_choice(choice: ToolChoice | None, tools: list[ToolParam] | None) -> tuple[bool, dict[str, Any]]:
    """Whether the reply's tool calls are parsed (``none``: the text is the reply, as generated), and the chain
    turn's sampling fields that force calls (docs/structured-outputs.md): ``any`` is one or more calls of the
    tools (one with ``disable_parallel_tool_use``), ``tool`` one call of the named tool, each call's input
    following its tool's ``input_schema``. A 400 names the field here, before the chain turn would name its own
    ``sampling.*`` fields."""
    if not isinstance(choice, (ToolChoiceAny, ToolChoiceTool)):
        return not isinstance(choice, ToolChoiceNone), {}
    indexed = list(enumerate(tools or []))
    if not indexed:
        raise bad_field("tool_choice", f"{choice.__struct_config__.tag!r} forces a tool call, which needs `tools`")
    if isinstance(choice, ToolChoiceTool):
        indexed = [(i, t) for i, t in indexed if t.name == choice.name]
        if not indexed:
            raise bad_field("tool_choice.name", f"names the tool {choice.name!r}, which is not among the tools")
    for i, t in indexed:
        if (why := schema_error(t.input_schema)) is not None:
            raise bad_field(f"tools[{i}].input_schema", f"the input_schema of {t.name!r} cannot be followed when "
                                                        f"tool_choice forces a call: {why}")
    if isinstance(choice, ToolChoiceTool):
        return True, {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    return True, {"tool_choice": "required", "parallel_tool_calls": not choice.disable_parallel_tool_use}


E = TypeVar("E", ClearToolUsesEdit, ClearThinkingEdit)


def context_edit(req: MessagesRequest, kind: type[E]) -> E | None:
    """The request's ``context_management`` edit of ``kind`` (at most one of each: a 400 naming the second)."""
    if req.context_management is None:
        return None
    edits = [(i, e) for i, e in enumerate(req.context_management.edits) if isinstance(e, kind)]
    for i, _ in edits[1:]:
        raise bad_field(f"context_management.edits[{i}]", f"give at most one {kind.__struct_config__.tag} edit")
    return edits[0][1] if edits else None
