"""The ``chain_id`` extension of POST /v1/chat/completions: the request's messages are the chain's whole
history, as the client saw it, followed by new messages; only the new ones become a chain turn.

The chain is an append-only log, so a request whose history differs from the chain's is a conflict (409
naming the first differing message) rather than a silent rewrite: to branch, fork or rewind the chain first,
or drop ``chain_id`` for a stateless completion. The system message is optional (the chain's own is implied);
an assistant message matches the chain's turn either as generated (tool-call markup in the text) or as this
route returned it (the text without its calls, ``tool_calls`` with the same names and arguments, read in the
model's tool-call syntax; ids are not compared).

Log-probabilities (``logprobs``) are refused with ``chain_id``: a chain turn does not carry them.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.exceptions import HTTPException

from agentrt.chain_state import ChainState
from agentrt.chat import Message
from agentrt.errors import bad_field
from agentrt.openai_types import (AssistantMessageIn, CompletionUsage, Content, DeveloperMessage,
                                  PromptTokensDetails, RefusalPart, SystemMessage, TextPart, ToolMessage,
                                  UserMessage)
from agentrt.openai_types import Message as OpenAIMessage
from agentrt.tool_syntax import ToolCallReader
from agentrt.tool_syntax.base import arguments_value
from sdk.schema import ToolCall, TurnCreate, Usage


class HistoryDiverged(HTTPException):
    status_code = 409

    def __init__(self, index: int, why: str):
        message = (f"{why}; the chain is append-only: fork or rewind it to branch, or leave out chain_id for a "
                   "stateless completion")
        super().__init__(detail=f"messages[{index}]: {message}",
                         extra=[{"message": message, "key": f"messages[{index}]", "source": "body"}])


def text_of(content: Content | None) -> str:
    """A message's text: its string, or its text parts joined (other parts are refused before this)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text if isinstance(part, TextPart) else part.refusal if isinstance(part, RefusalPart) else ""
                   for part in content)


def _calls(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.function.name, arguments_value(c.function.arguments)) for c in calls]


def _differs(sent: OpenAIMessage, kept: Message, reader: ToolCallReader) -> str | None:
    """Why ``sent`` is not the chain's message ``kept`` (None when it is); ``reader`` reads the kept calls."""
    role = "system" if isinstance(sent, DeveloperMessage) else str(sent.__struct_config__.tag)
    if role != kept["role"]:
        return f"the chain has a {kept['role']} message here, not a {role} message"
    text = text_of(sent.content)
    if isinstance(sent, AssistantMessageIn):
        raw = kept["content"]
        calls = reader.reply_calls(raw)
        sent_calls = _calls(sent.tool_calls or [])
        if text == raw and (not sent_calls or sent_calls == _calls(calls)):
            return None
        if sent_calls == _calls(calls) and text == reader.reply_content(raw):
            return None
        return "differs from the chain's assistant message"
    if text != kept["content"]:
        return f"its content differs from the chain's {role} message"
    if isinstance(sent, ToolMessage) and sent.tool_call_id != kept.get("tool_call_id"):
        return "its tool_call_id differs from the chain's tool message"
    return None


def new_messages(sent: list[OpenAIMessage], state: ChainState,
                 reader: ToolCallReader) -> tuple[int, list[OpenAIMessage]]:
    """The index of the first message after the chain's history, and the messages from there; HistoryDiverged
    when ``sent`` does not start with the history (its calls read by ``reader``)."""
    system = state.system_message()
    kept = state.history[1:] if state.history else []
    start = 0
    if sent and isinstance(sent[0], (SystemMessage, DeveloperMessage)):
        if (why := _differs(sent[0], system, reader)) is not None:
            raise HistoryDiverged(0, why)
        start = 1
    for i, message in enumerate(kept):
        if start + i >= len(sent):
            raise HistoryDiverged(len(sent), f"the chain's history has {len(kept) - i} more messages than sent")
        if (why := _differs(sent[start + i], message, reader)) is not None:
            raise HistoryDiverged(start + i, why)
    offset = start + len(kept)
    if offset == len(sent):
        raise bad_field("messages", "nothing follows the chain's history: add a user or tool message")
    return offset, sent[offset:]


def turn_request(new: list[OpenAIMessage], offset: int, sampling: dict[str, Any], stream: bool) -> TurnCreate:
    """The chain turn for the new messages (``offset``: the index of the first of them in the request)."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(new):
        if isinstance(m, UserMessage):
            messages.append({"role": "user", "content": text_of(m.content)})
        elif isinstance(m, ToolMessage):
            messages.append({"role": "tool", "content": text_of(m.content), "tool_call_id": m.tool_call_id,
                             **({"name": m.name} if m.name else {})})
        else:
            raise bad_field(f"messages[{offset + i}]", "after the chain's history only user and tool messages may "
                                                       "follow (a chain turn appends them, then generates)")
    try:
        return msgspec.convert({"messages": messages, "sampling": sampling, "stream": stream}, TurnCreate)
    except msgspec.ValidationError as exc:
        raise bad_field("messages", str(exc)) from None


def usage(u: Usage) -> CompletionUsage:
    """``cached_tokens``: prompt tokens this request did not compute (the engine counts the chain's resumed KV,
    or else prefix-cache hits)."""
    return CompletionUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                           total_tokens=u.prompt_tokens + u.completion_tokens,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))
