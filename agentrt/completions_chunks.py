"""The chunks of a streamed chat completion (``stream: true``): the same message as the non-streamed reply
(agentrt.completions_output), its text released as it is generated. The text goes through a ToolCallStream, so
markup never arrives as content, and each call arrives as one ``tool_calls`` delta; a thinking model's think
block arrives as ``delta.reasoning_content`` chunks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING

import msgspec

from agentrt import chain_completions
from agentrt.completions_output import (TokenText, chain_message, chain_turn, choice_logprobs, finished_output,
                                        request_usage)
from agentrt.errors import openai_error_body
from agentrt.metrics import Metrics
from agentrt.openai_types import (ChainCompletionChunk, ChainTurn, ChatCompletionChunk, ChoiceLogprobs, ChunkChoice,
                                  CompletionUsage, Delta, ToolCallDelta)
from agentrt.reasoning import parser as reasoning_parser
from sdk.schema import ToolCall, TurnDelta, TurnResult

if TYPE_CHECKING:
    from agentrt.completions import Completion

log = logging.getLogger(__name__)


async def chunks(c: Completion, tokens: TokenText, metrics: Metrics) -> AsyncGenerator[str, None]:
    """The SSE data of a streamed completion: a role chunk, content and tool-call chunks, a chunk with the
    finish reason, the usage chunk (with ``include_usage``), ``[DONE]``. An error after the response
    started arrives as an event whose data is OpenAI's error object (what the OpenAI clients raise)."""
    def chunk(delta: Delta, finish: str | None = None, usage: CompletionUsage | None = None,
              choices: bool = True, chain: ChainTurn | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
        fields = dict(id=c.id, created=c.created, model=c.model, usage=usage,
                      choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish, logprobs=logprobs)]
                      if choices else [])
        body = ChatCompletionChunk(**fields) if chain is None else ChainCompletionChunk(**fields, chain=chain)
        return msgspec.json.encode(body).decode()

    def calls_delta(calls: list[ToolCall], first: int) -> Delta:
        return Delta(tool_calls=[ToolCallDelta(index=first + i, id=t.id, function=t.function)
                                 for i, t in enumerate(calls)])

    parser = c.calls.stream() if c.calls is not None else None
    thinking = reasoning_parser(c.thinking)

    def split(text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) that a piece of the text (or its end) releases."""
        reasoning, rest = "", text
        if thinking is not None:
            reasoning, rest = thinking.finish() if final else thinking.feed(text)
        if parser is None:
            return reasoning, rest, []
        content, calls = parser.feed(rest) if rest else ("", [])
        if final:
            more, more_calls = parser.finish()
            content, calls = content + more, calls + more_calls
        return reasoning, content, calls

    try:
        yield chunk(Delta(role="assistant"))
        if c.turn is not None:
            result: TurnResult | None = None
            async with aclosing(c.turn.events()) as events:
                async for event in events:
                    if isinstance(event, TurnDelta):
                        reasoning, text, _ = split(event.text)
                        if reasoning or text:
                            yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
                    else:
                        result = event
            assert result is not None
            reasoning, text, _ = split("", final=True)
            if reasoning or text:
                yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
            message, finish = chain_message(result, c.calls, reasoning_parser(c.thinking))
            if message.tool_calls:  # the chain's ids: its tool results are matched to its calls by id
                yield chunk(calls_delta(message.tool_calls, 0))
            yield chunk(Delta(), finish, chain=chain_turn(result))
            if c.include_usage:
                yield chunk(Delta(), usage=chain_completions.usage(result.usage), choices=False)
            yield "[DONE]"
            return
        last = None
        sent_calls = 0
        async with aclosing(c.stream.outputs()) as outputs:
            async for out in outputs:
                last = out
                reasoning, text, calls = split(out.new_text)
                logprobs = None
                if c.logprobs and out.new_token_ids:
                    n = len(out.new_token_ids)
                    top = out.top_logprobs
                    logprobs = choice_logprobs(tokens, c.top_logprobs, out.new_token_ids, (out.logprobs or [])[-n:],
                                               top[-n:] if top else None)
                if reasoning or text or logprobs:
                    yield chunk(Delta(reasoning_content=reasoning or None, content=text or None),
                                logprobs=logprobs)
                if calls:
                    yield chunk(calls_delta(calls, sent_calls))
                    sent_calls += len(calls)
        last = finished_output(last, metrics)
        reasoning, text, calls = split("", final=True)
        if reasoning or text:
            yield chunk(Delta(reasoning_content=reasoning or None, content=text or None))
        if calls:
            yield chunk(calls_delta(calls, sent_calls))
            sent_calls += len(calls)
        finish = last.finish_reason or "stop"
        yield chunk(Delta(), "tool_calls" if sent_calls and finish == "stop" else finish)
        if c.include_usage:
            yield chunk(Delta(), usage=request_usage(last), choices=False)
        yield "[DONE]"
    except Exception as exc:  # the status line is sent: the error goes into the stream
        log.info("stream %s failed: %r", c.id, exc)
        yield msgspec.json.encode(openai_error_body(exc)).decode()
