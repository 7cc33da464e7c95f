"""A Messages reply's content blocks, its usage, and the events of a streamed reply.

The reply's content is the generated text split by the model's tool-call syntax (agentrt.tool_syntax): text
blocks between ``tool_use`` blocks (one per complete call, id ``toolu_...``, ``input`` its arguments), markup
never as text, whitespace stripped as the syntax's reader strips content. A stream gives the same blocks (the same
``BlockWriter``): each text block as it is released, each tool_use block as soon as its markup is complete.

A model that thinks (agentrt.reasoning) has its think block as a ``thinking`` block first (streamed as
``thinking_delta`` events, then a ``signature_delta``; the signature is the constant ``THINKING_SIGNATURE``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgspec
from litestar.response import ServerSentEventMessage
from msgspec import UNSET, UnsetType

from agentrt.anthropic_errors import anthropic_error_body
from agentrt.anthropic_types import (ContentBlock, ContentBlockDeltaEvent, ContentBlockStartEvent,
                                     ContentBlockStopEvent, ContextManagementResponse, InputJSONDelta, Message,
                                     MessageDelta, MessageDeltaEvent, MessageStartEvent, MessageStopEvent,
                                     SignatureDelta, StopReason, TextBlock, TextDelta, ThinkingBlock, ThinkingDelta,
                                     ToolUseBlock, Usage)
from agentrt.implicit_chains import Resolved
from agentrt.reasoning import parser as reasoning_parser
from agentrt.tool_syntax import ToolCallReader
from agentrt.tool_syntax.base import arguments_value
from sdk.schema import ToolCall, TurnDelta, TurnResult

if TYPE_CHECKING:
    from agentrt.turns import PendingTurn

log = logging.getLogger(__name__)
THINKING_SIGNATURE = "agentrt-unsigned"  # every thinking block's: opaque to clients, never checked here


@dataclass(slots=True)
class Pending:
    """A reply whose chain turn has started: what writing it, whole or streamed, needs."""

    id: str
    turn: PendingTurn
    resolved: Resolved
    calls: ToolCallReader | None  # None with tool_choice "none": the text as generated
    prefix: str | None
    stop_sequences: list[str]
    context_management: ContextManagementResponse | UnsetType = UNSET
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    show_thinking: bool = True  # False: ``display: "omitted"``

    async def close(self) -> None:
        """For a response that ended before its stream was consumed (client gone)."""
        await self.turn.close()


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as a tool_use ``input`` (an object: arguments that are not one are wrapped)."""
    value = arguments_value(call.function.arguments)
    return value if isinstance(value, dict) else {"arguments": value}


BlockEvent = ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent


class BlockWriter:
    """Generated text, fed in any pieces, to content blocks and the stream events that build them; the blocks
    do not depend on how the text was cut (a piece is split after each closing tag, so that the text before a
    call is released before the call). A thinking model's think block becomes a thinking block first."""

    def __init__(self, reader: ToolCallReader | None, prefix: str | None = None, thinking: bool | None = None,
                 show_thinking: bool = True):
        """``reader``: how calls are read (None: the text is all text). ``prefix``: the text the reply continues
        (a final assistant message), not part of the reply: parsed first, so that the reply's leading whitespace
        is kept and a tool call (or think block) opened in it still completes. ``thinking``:
        ``ChatRenderer.thinking`` of the prompt (None: the model does not think); ``show_thinking`` False:
        thinking blocks carry no text (``display: "omitted"``)."""
        self.parser = reader.stream() if reader is not None else None
        self._close_text = reader.syntax.close if reader is not None else ""
        self.reasoning = reasoning_parser(thinking)
        self.show_thinking = show_thinking
        self.blocks: list[ContentBlock] = []
        self._open = False  # the last block is still growing
        self._tail = ""  # the end of the text fed so far, where a closing tag may have begun
        if prefix and (self.parser is not None or self.reasoning is not None):
            self.feed(prefix)
            self.blocks, self._open = [], False

    def feed(self, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            events += self._thinking(thought)
        return events + self._content(text)

    def _content(self, text: str) -> list[BlockEvent]:
        if self.parser is None:
            return self._text(text)
        events: list[BlockEvent] = []
        for piece in self._pieces(text):
            content, calls = self.parser.feed(piece)
            events += self._text(content)
            for call in calls:
                events += self._call(call)
        return events

    def finish(self) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.finish()
            events += self._thinking(thought) + self._content(text)
        if self.parser is not None:
            content, calls = self.parser.finish()
            events += self._text(content)
            for call in calls:
                events += self._call(call)
        return events + self._close()

    def whole(self, text: str) -> list[ContentBlock]:
        self.feed(text)
        self.finish()
        return self.blocks

    def _pieces(self, text: str) -> list[str]:
        joined, pieces, start = self._tail + text, [], 0
        for at in _find_all(joined, self._close_text):  # every block, well-formed or not, ends at one
            end = at + len(self._close_text) - len(self._tail)
            if end > start:
                pieces.append(text[start:end])
                start = end
        pieces.append(text[start:])
        self._tail = joined[-(len(self._close_text) - 1):]
        return [p for p in pieces if p]

    def _close(self) -> list[BlockEvent]:
        """Close the open block (a thinking block gets its signature first)."""
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        events: list[BlockEvent] = []
        if isinstance(self.blocks[index], ThinkingBlock):
            events.append(ContentBlockDeltaEvent(index=index, delta=SignatureDelta(signature=THINKING_SIGNATURE)))
        return events + [ContentBlockStopEvent(index=index)]

    def _open_block(self, block: ContentBlock, announced: ContentBlock) -> list[BlockEvent]:
        """Unless a block of ``block``'s kind is open, close the open one and open ``block`` (its start event
        carries ``announced``)."""
        if self._open and isinstance(self.blocks[-1], type(block)):
            return []
        events = self._close()
        self.blocks.append(block)
        self._open = True
        return events + [ContentBlockStartEvent(index=len(self.blocks) - 1, content_block=announced)]

    def _thinking(self, thought: str) -> list[BlockEvent]:
        if not thought:
            return []
        events = self._open_block(ThinkingBlock(thinking="", signature=THINKING_SIGNATURE),
                                  ThinkingBlock(thinking="", signature=""))
        if self.show_thinking:
            cast(ThinkingBlock, self.blocks[-1]).thinking += thought
            events.append(ContentBlockDeltaEvent(index=len(self.blocks) - 1, delta=ThinkingDelta(thinking=thought)))
        return events

    def _text(self, content: str) -> list[BlockEvent]:
        if not content:
            return []
        events = self._open_block(TextBlock(text=""), TextBlock(text=""))
        block = cast(TextBlock, self.blocks[-1])
        block.text += content
        events.append(ContentBlockDeltaEvent(index=len(self.blocks) - 1, delta=TextDelta(text=content)))
        return events

    def _call(self, call: ToolCall) -> list[BlockEvent]:
        events = self._close()
        block = ToolUseBlock(id=f"toolu_{call.id.removeprefix('call_')}", name=call.function.name,
                             input=tool_input(call))
        self.blocks.append(block)
        index = len(self.blocks) - 1
        events += [ContentBlockStartEvent(index=index, content_block=ToolUseBlock(id=block.id, name=block.name,
                                                                                   input={})),
                   ContentBlockDeltaEvent(index=index, delta=InputJSONDelta(
                       partial_json=json.dumps(block.input, ensure_ascii=False))),
                   ContentBlockStopEvent(index=index)]
        return events


def _find_all(text: str, sub: str) -> list[int]:
    out, at = [], text.find(sub)
    while at >= 0:
        out.append(at)
        at = text.find(sub, at + 1)
    return out


def usage(result: TurnResult, imported: list[TurnResult]) -> Usage:
    """``input_tokens``: the prompt tokens this request computed (its turns' prefills: the new part, plus the
    token the chain's KV lacks, its last generated one); ``cache_read_input_tokens``: the rest of the prompt,
    reused (resumed from the chain, or from the prefix cache)."""
    computed = result.usage.prefilled_tokens + sum(t.usage.prefilled_tokens for t in imported)
    return Usage(input_tokens=computed, output_tokens=result.usage.completion_tokens,
                 cache_read_input_tokens=max(0, result.usage.prompt_tokens - computed))


def expected_usage(pending: Pending) -> Usage:
    """message_start's usage, before the engine has run: what a resumed chain would reuse (message_delta carries
    the counts)."""
    turn, imported = pending.turn, pending.resolved.imported
    resumable = max(0, len(turn.state.token_ids) - 1) if turn.state.num_turns else 0
    computed = len(turn.prompt) - resumable + sum(t.usage.prefilled_tokens for t in imported)
    return Usage(input_tokens=computed, output_tokens=0,
                 cache_read_input_tokens=max(0, len(turn.prompt) - computed))


def sse(event: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=event.__struct_config__.tag, data=msgspec.json.encode(event).decode())


async def events(pending: Pending, model_name: str,
                 stop: Callable[[TurnResult, Pending, list[ContentBlock]], tuple[StopReason, str | None]]
                 ) -> AsyncGenerator[ServerSentEventMessage, None]:
    """The SSE events of a streamed reply (Anthropic's order); ``stop``: the reply's stop reason and stop
    sequence. An error once the stream has started is an ``error`` event, and the stream ends there."""
    start = Message(id=pending.id, type="message", role="assistant", content=[], model=model_name,
                    stop_reason=None, stop_sequence=None, usage=expected_usage(pending))
    yield sse(MessageStartEvent(message=start))
    writer = BlockWriter(pending.calls, pending.prefix, pending.thinking, pending.show_thinking)
    try:
        result: TurnResult | None = None
        async with aclosing(pending.turn.events()) as turn_events:
            async for event in turn_events:
                if isinstance(event, TurnDelta):
                    for e in writer.feed(event.text):
                        yield sse(e)
                else:
                    result = event
        assert result is not None
        for e in writer.finish():
            yield sse(e)
        reason, sequence = stop(result, pending, writer.blocks)
        yield sse(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                    usage=usage(result, pending.resolved.imported),
                                    context_management=pending.context_management))
        yield sse(MessageStopEvent())
    except Exception as exc:  # the status line is sent: the error goes into the stream
        log.info("stream %s failed: %r", pending.id, exc)
        yield ServerSentEventMessage(event="error", data=msgspec.json.encode(anthropic_error_body(exc)).decode())
