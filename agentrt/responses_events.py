"""A response's output: its items, the finished response object, and the events of a streamed response.

The output is one ``message`` item holding the reply's text without its tool-call markup (when there is any
text), then one ``function_call`` item per call, with the chain's call ids. A stream sends the text as it is
released (agentrt.tool_syntax.ToolCallStream) and the calls once the turn has ended, so its items equal the non-streamed
ones. A model that thinks (agentrt.reasoning) has its think block as a ``reasoning`` item first (``content:
[{"type": "reasoning_text", "text"}]``, streamed as ``response.reasoning_text.delta`` events).

``usage.input_tokens_details.cached_tokens``: the prompt tokens this request did not compute (the turn's prompt
less its prefill and the prefill of any history imported for it).
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from agentrt.conversations_items import call_item_id
from agentrt.errors import openai_error_body
from agentrt.reasoning import ReasoningParser, split_reasoning
from agentrt.reasoning import parser as reasoning_parser
from agentrt.responses_store import Record
from agentrt.responses_types import (IncompleteDetails, InputTokensDetails, OutputFunctionCall, OutputMessage,
                                     OutputReasoning, OutputTextPart, OutputTokensDetails, ReasoningTextPart,
                                     ResponseObject, ResponseUsage)
from agentrt.tool_syntax import ToolCallReader
from sdk.schema import TurnDelta, TurnResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    response: ResponseObject
    record: Record
    turn: Any  # agentrt.turns.PendingTurn
    calls: ToolCallReader | None  # None with tool_choice "none": the text as generated
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as input_items lists them; [] unless stored
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    imported: list[TurnResult] = field(default_factory=list)  # history turns this request appended first
    item_key: str | None = None  # a conversation's turn: its output item ids (agentrt.conversations_items.output_ids)
    message_id: str = ""  # the output's message / reasoning item ids
    reasoning_id: str = ""
    done: ResponseObject | None = None  # the finished response, made when the turn commits
    seq: int = 0
    items: list[Any] = field(default_factory=list)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    f = tool["function"]
    return {"type": "function", "name": f["name"], "description": f.get("description"),
            "parameters": f.get("parameters"), "strict": False}


def finished_response(pending: Pending, result: TurnResult, output: list[Any], reasoning: int) -> ResponseObject:
    u = result.usage
    computed = u.prefilled_tokens + sum(t.usage.prefilled_tokens for t in pending.imported)
    cached = max(0, u.prompt_tokens - computed)
    response = msgspec.structs.replace(
        pending.response, output=output,
        status="incomplete" if result.finish_reason == "length" else "completed",
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if result.finish_reason == "length"
        else None,
        usage=ResponseUsage(input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(
            cached_tokens=cached), output_tokens=u.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=u.prompt_tokens + u.completion_tokens))
    return response


def reasoning_tokens(pending: Pending, result: TurnResult, generated: list[int], think: Any) -> int:
    """The generated tokens of the think block: up to its closing tag, or all of them when it never closed
    (``think``: the renderer's think tags, None when the model does not think)."""
    if pending.thinking is None or think is None:
        return 0
    parser = ReasoningParser(pending.thinking)
    parser.feed(result.message.content)
    parser.finish()
    n = len(generated)
    if not parser.found or not n:
        return 0
    return generated.index(think.close_id) + 1 if think.close_id in generated else n


def output_items(result: TurnResult, pending: Pending) -> list[Any]:
    thought, text = "", result.message.content
    if pending.thinking is not None:
        thought, text = split_reasoning(text, pending.thinking)
    calls = []
    if pending.calls is not None:
        chain_calls = result.message.tool_calls  # the chain's ids: its tool results are matched to them
        calls = chain_calls[len(chain_calls) - min(len(pending.calls.calls_in(text)), len(chain_calls)):]
        text = pending.calls.without_calls(text)
    output: list[Any] = []
    key = pending.item_key  # a conversation's turn: its message / reasoning ids are the conversation's
    if thought:
        output.append(OutputReasoning(id=pending.reasoning_id, content=[ReasoningTextPart(text=thought)]))
    if text:
        output.append(OutputMessage(id=pending.message_id, content=[OutputTextPart(text=text)]))
    output += [OutputFunctionCall(id=call_item_id(key, j) if key is not None else new_id("fc"), call_id=c.id,
                                  name=c.function.name, arguments=c.function.arguments)
               for j, c in enumerate(calls)]
    return output


def stream_event(pending: Pending, kind: str, **body: Any) -> ServerSentEventMessage:
    data = {"type": kind, "sequence_number": pending.seq, **msgspec.to_builtins(body)}
    pending.seq += 1
    return ServerSentEventMessage(event=kind, data=json.dumps(data, ensure_ascii=False))


async def events(pending: Pending, finish: Callable[[Pending], ResponseObject]
                 ) -> AsyncGenerator[ServerSentEventMessage, None]:
    """The stream's events (``finish``: the committed turn's response)."""
    ev = stream_event
    yield ev(pending, "response.created", response=pending.response)
    yield ev(pending, "response.in_progress", response=pending.response)
    parser = pending.calls.stream() if pending.calls is not None else None
    thinking = reasoning_parser(pending.thinking)
    rs_id, msg_id = pending.reasoning_id, pending.message_id
    thought, text = "", ""
    thought_done = False  # the reasoning item's done events were sent

    def close_reasoning() -> list[ServerSentEventMessage]:
        nonlocal thought_done
        if not thought or thought_done:
            return []
        thought_done = True
        part = ReasoningTextPart(text=thought)
        return [ev(pending, "response.reasoning_text.done", item_id=rs_id, output_index=0, content_index=0,
                   text=thought),
                ev(pending, "response.content_part.done", item_id=rs_id, output_index=0, content_index=0,
                   part=part),
                ev(pending, "response.output_item.done", output_index=0,
                   item=OutputReasoning(id=rs_id, content=[part]))]

    def deltas(piece: str, final: bool = False) -> list[ServerSentEventMessage]:
        nonlocal thought, text
        reasoning, rest = "", piece
        if thinking is not None:
            reasoning, rest = thinking.finish() if final else thinking.feed(piece)
        out = reasoning_delta(pending, rs_id, thought, reasoning)
        thought += reasoning
        if parser is not None:
            rest = parser.feed(rest)[0] if rest else ""
            if final:
                rest += parser.finish()[0]
        if rest:
            out += close_reasoning()
            out += text_delta(pending, msg_id, 1 if thought else 0, text, rest)
            text += rest
        return out

    try:
        result: TurnResult | None = None
        async with aclosing(pending.turn.events()) as stream:
            async for event in stream:
                if not isinstance(event, TurnDelta):
                    result = event
                    continue
                for e in deltas(event.text):
                    yield e
        assert result is not None
        for e in deltas("", final=True) + close_reasoning():
            yield e
        response = finish(pending)
        output = response.output
        index = 1 if thought else 0
        if text:
            part = OutputTextPart(text=text)
            yield ev(pending, "response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                     text=text, logprobs=[])
            yield ev(pending, "response.content_part.done", item_id=msg_id, output_index=index,
                     content_index=0, part=part)
            yield ev(pending, "response.output_item.done", output_index=index, item=output[index])
            index += 1
        for item in output[index:]:
            added = msgspec.structs.replace(item, arguments="", status="in_progress")
            yield ev(pending, "response.output_item.added", output_index=index, item=added)
            yield ev(pending, "response.function_call_arguments.delta", item_id=item.id, output_index=index,
                     delta=item.arguments)
            yield ev(pending, "response.function_call_arguments.done", item_id=item.id, output_index=index,
                     name=item.name, arguments=item.arguments)
            yield ev(pending, "response.output_item.done", output_index=index, item=item)
            index += 1
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield ev(pending, kind, response=response)
    except Exception as exc:  # the status line is sent: the error goes into the stream
        log.info("response stream %s failed: %r", pending.response.id, exc)
        error = msgspec.to_builtins(openai_error_body(exc)).get("error", {})
        yield ev(pending, "error", code=error.get("code"), message=error.get("message", str(exc)),
                 param=error.get("param"))


def reasoning_delta(pending: Pending, rs_id: str, before: str, delta: str) -> list[ServerSentEventMessage]:
    if not delta:
        return []
    events = []
    if not before:
        item = OutputReasoning(id=rs_id, content=[], status="in_progress")
        events.append(stream_event(pending, "response.output_item.added", output_index=0, item=item))
        events.append(stream_event(pending, "response.content_part.added", item_id=rs_id, output_index=0,
                                   content_index=0, part=ReasoningTextPart(text="")))
    events.append(stream_event(pending, "response.reasoning_text.delta", item_id=rs_id, output_index=0,
                               content_index=0, delta=delta))
    return events


def text_delta(pending: Pending, msg_id: str, index: int, before: str, delta: str) -> list[ServerSentEventMessage]:
    if not delta:
        return []
    events = []
    if not before:
        item = OutputMessage(id=msg_id, content=[], status="in_progress")
        events.append(stream_event(pending, "response.output_item.added", output_index=index, item=item))
        events.append(stream_event(pending, "response.content_part.added", item_id=msg_id, output_index=index,
                                   content_index=0, part=OutputTextPart(text="")))
    events.append(stream_event(pending, "response.output_text.delta", item_id=msg_id, output_index=index,
                               content_index=0, delta=delta, logprobs=[]))
    return events
