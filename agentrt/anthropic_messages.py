"""Anthropic's Messages API over implicit chains (agentrt.implicit_chains).

A request carries the whole conversation. It is converted to the chain routes' messages: a user message's text
blocks become one user message (joined by a newline), each ``tool_result`` a tool message (its text blocks
joined by a newline, ``Error: `` before the text when ``is_error``; ``name`` from the ``tool_use`` it answers),
an assistant message its text (blocks joined) and its ``tool_use`` blocks as calls (consecutive assistant
messages are one, as Anthropic merges them); a final assistant message is the reply's prefix (the turn's
``assistant_prefix``; the reply holds only what follows it). The conversation's chain is resolved (resumed,
forked or created; earlier history the chain lacks imported), the request's ``context_management`` edits run
on it as pruning, and the new messages become one chain turn.

The reply's content is the generated text split by the tool-call rules of agentrt.chat: text blocks between
``tool_use`` blocks (one per complete ``<tool_call>`` block, id ``toolu_...``, ``input`` its arguments),
markup never as text, whitespace as ``strip_tool_calls`` leaves it. A stream gives the same blocks (the same
``BlockWriter``): each text block as it is released, each tool_use block as soon as its markup is complete.
``tool_choice`` ``any`` / ``tool`` become the turn's ``sampling.tool_choice`` (``required`` / the named function;
docs/structured-outputs.md), so constrained decoding makes the reply those calls and nothing else.

A model that thinks (agentrt.reasoning) has its think block as a ``thinking`` block first (streamed as
``thinking_delta`` events, then a ``signature_delta``; the signature is the constant ``THINKING_SIGNATURE``);
the request's ``thinking`` is the chat template's ``enable_thinking`` (``enabled``: on, ``disabled``: off,
``adaptive`` or none: the template's default). Thinking blocks a client sends back in assistant messages are
skipped: the conversation's chain holds the reasoning as generated.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEventMessage
from msgspec import UNSET, UnsetType

from agentrt.anthropic_errors import anthropic_error_body
from agentrt.anthropic_types import (ClearThinkingEdit, ClearToolUsesApplied, ClearToolUsesEdit, ContentBlock,
                                     ContentBlockDeltaEvent,
                                     ContentBlockStartEvent, ContentBlockStopEvent, ContextManagementResponse,
                                     CountTokensContextManagement, CountTokensRequest, CountTokensResponse,
                                     DocumentBlockParam, ImageBlockParam, InputJSONDelta, InputTokens, Message,
                                     MessageDelta, MessageDeltaEvent, MessagesRequest, MessageStartEvent,
                                     MessageStopEvent, RedactedThinkingBlockParam, SearchResultBlockParam,
                                     SignatureDelta, StopReason, TextBlock, TextBlockParam, TextDelta, Thinking,
                                     ThinkingAdaptive, ThinkingBlock, ThinkingBlockParam, ThinkingDelta,
                                     ThinkingDisabled, ThinkingEnabled, ToolChoice, ToolChoiceAny, ToolChoiceNone,
                                     ToolChoiceTool, ToolParam, ToolResultBlockParam, ToolUseBlock, ToolUseBlockParam,
                                     ToolUses, Usage)
from agentrt.chat import Message as ChainMessage
from agentrt.chat import template_kwargs
from agentrt.errors import ModelNotFound, bad_field
from agentrt.clear_thinking import clear_thinking
from agentrt.implicit_chains import ImplicitChains, Resolved, arguments_value, implicit_chains_of, turn_create
from agentrt.reasoning import parser as reasoning_parser
from agentrt.tool_call_stream import ToolCallStream
from agentrt.tool_input_spans import call_input_spans, covered, merged
from engine.errors import InvalidRequestError
from engine.structured_output import schema_error
from sdk.schema import FunctionDef, PruneRequest, Tool, ToolCall, TurnDelta, TurnResult

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from agentrt.config import ServerConfig
    from agentrt.turns import PendingTurn

log = logging.getLogger(__name__)
CLOSE_TAG = "</tool_call>"
DEFAULT_TRIGGER_TOKENS = 100_000  # clear_tool_uses_20250919's defaults
DEFAULT_KEEP_TOOL_USES = 3
READS_KEPT = 1024  # assistant turns whose tool-call input spans are kept read (MessagesService._input_spans)
THINKING_SIGNATURE = "agentrt-unsigned"  # every thinking block's: opaque to clients, never checked here


class ChainMoved(HTTPException):
    """The resolved chain gained a turn through another route before this request's turn started (retryable:
    the next resolution sees the new history)."""

    status_code = 409


# --- the request -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Conversation:
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


def _edit(req: MessagesRequest, kind: type[E]) -> E | None:
    """The request's ``context_management`` edit of ``kind`` (at most one of each: a 400 naming the second)."""
    if req.context_management is None:
        return None
    edits = [(i, e) for i, e in enumerate(req.context_management.edits) if isinstance(e, kind)]
    for i, _ in edits[1:]:
        raise bad_field(f"context_management.edits[{i}]", f"give at most one {kind.__struct_config__.tag} edit")
    return edits[0][1] if edits else None


def _clears_input(edit: ClearToolUsesEdit, tool_name: str | None) -> bool:
    """Whether ``edit`` clears the input of a cleared use of ``tool_name`` (never one of ``exclude_tools``)."""
    if tool_name in (edit.exclude_tools or []):
        return False
    if isinstance(edit.clear_tool_inputs, list):
        return tool_name in edit.clear_tool_inputs
    return bool(edit.clear_tool_inputs)


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as a tool_use ``input`` (an object: arguments that are not one are wrapped)."""
    value = arguments_value(call.function.arguments)
    return value if isinstance(value, dict) else {"arguments": value}


# --- the reply's content blocks ---------------------------------------------------------------------------------
BlockEvent = ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent


class BlockWriter:
    """Generated text, fed in any pieces, to content blocks and the stream events that build them; the blocks
    do not depend on how the text was cut (a piece is split after each closing tag, so that the text before a
    call is released before the call). A thinking model's think block becomes a thinking block first."""

    def __init__(self, parse_calls: bool = True, prefix: str | None = None, thinking: bool | None = None,
                 show_thinking: bool = True):
        """``prefix``: the text the reply continues (a final assistant message), not part of the reply: parsed
        first, so that the reply's leading whitespace is kept and a tool call (or think block) opened in it still
        completes. ``thinking``: ``ChatRenderer.thinking`` of the prompt (None: the model does not think);
        ``show_thinking`` False: thinking blocks carry no text (``display: "omitted"``)."""
        self.parser = ToolCallStream() if parse_calls else None
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
        for at in _find_all(joined, CLOSE_TAG):  # every block, well-formed or not, ends at one
            end = at + len(CLOSE_TAG) - len(self._tail)
            if end > start:
                pieces.append(text[start:end])
                start = end
        pieces.append(text[start:])
        self._tail = joined[-(len(CLOSE_TAG) - 1):]
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

    def _thinking(self, thought: str) -> list[BlockEvent]:
        if not thought:
            return []
        events: list[BlockEvent] = []
        if not (self._open and isinstance(self.blocks[-1], ThinkingBlock)):
            events += self._close()
            self.blocks.append(ThinkingBlock(thinking="", signature=THINKING_SIGNATURE))
            events.append(ContentBlockStartEvent(index=len(self.blocks) - 1,
                                                 content_block=ThinkingBlock(thinking="", signature="")))
            self._open = True
        if self.show_thinking:
            cast(ThinkingBlock, self.blocks[-1]).thinking += thought
            events.append(ContentBlockDeltaEvent(index=len(self.blocks) - 1, delta=ThinkingDelta(thinking=thought)))
        return events

    def _text(self, content: str) -> list[BlockEvent]:
        if not content:
            return []
        events: list[BlockEvent] = []
        if not (self._open and isinstance(self.blocks[-1], TextBlock)):
            events += self._close()
            self.blocks.append(TextBlock(text=""))
            events.append(ContentBlockStartEvent(index=len(self.blocks) - 1, content_block=TextBlock(text="")))
            self._open = True
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


# --- the service --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Pending:
    id: str
    turn: PendingTurn
    resolved: Resolved
    parse_calls: bool
    prefix: str | None
    stop_sequences: list[str]
    context_management: ContextManagementResponse | UnsetType = UNSET
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    show_thinking: bool = True  # False: ``display: "omitted"``

    async def close(self) -> None:
        """For a response that ended before its stream was consumed (client gone)."""
        await self.turn.close()


class MessagesService:
    def __init__(self, chains: ChainService, implicit: ImplicitChains, model_name: str, config: ServerConfig):
        self.chains = chains
        self.implicit = implicit
        self.model_name = model_name
        self.config = config
        # (chain, region, start, hash of its tokens) of an assistant turn -> its calls' input spans
        # (agentrt.tool_input_spans.call_input_spans), the most recently read last
        self._reads: dict[tuple[str, int, int, int], list[tuple[str, Any, int, int] | None]] = {}

    # --- requests ---------------------------------------------------------------------------------------
    def _check(self, req: MessagesRequest) -> dict[str, Any]:
        """Refuse, with a 400 naming the field, what cannot be honored; the turn's sampling."""
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        # a larger max_tokens (agent clients ask for tens of thousands) is lowered to the server's per-turn limit
        # and by the engine to what the context holds: stop_reason "max_tokens" where it runs out
        max_tokens = min(req.max_tokens, self.config.max_tokens_per_turn)
        if req.container is not None:
            raise bad_field("container", "this server runs no code-execution containers")
        if req.mcp_servers:
            raise bad_field("mcp_servers", "this server connects to no MCP servers: leave it out or empty")
        forced = list(req.agentrt_forced_token_ids or [])
        vocab = self.chains.worker.engine.model_config.vocab_size
        if len(forced) > max_tokens:
            raise bad_field("agentrt_forced_token_ids", f"has {len(forced)} tokens, more than max_tokens "
                                                        f"({max_tokens})")
        if any(t >= vocab for t in forced):
            raise bad_field("agentrt_forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        greedy = req.top_p == 0  # a nucleus of one token; the engine takes top_p in (0, 1]
        structured: dict[str, Any] = {}
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:  # the reply's text follows the schema (with tools: that JSON or tool calls)
            if (why := schema_error(fmt.schema)) is not None:
                raise bad_field("output_config.format.schema", f"cannot be followed: {why}")
            structured["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema, "strict": True}}
        return {**structured, "temperature": 0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None or greedy else req.top_p,
                "top_k": -1 if req.top_k is None else req.top_k, "max_tokens": max_tokens, "fit_max_tokens": True,
                "stop": list(req.stop_sequences or []), "forced_token_ids": forced}

    async def start(self, req: MessagesRequest, tenant: str) -> Pending:
        """Resolve the conversation's chain, apply its context management, start the turn (raises before any
        reply: 400 / 404 / 413 / 429 / 503)."""
        sampling = self._check(req)
        parse_calls, forced_calls = check_tool_choice(req.tool_choice, req.tools)
        sampling.update(forced_calls)
        edit = _edit(req, ClearToolUsesEdit)
        renderer = self.chains.renderer.renderer
        conv = conversation(req, thinks=renderer.think is not None)
        session = req.metadata.user_id if req.metadata is not None else None
        async with self.implicit.resolve(tenant, session, conv.system, conv.tools, conv.messages,
                                         conv.names) as resolved:
            managed: ContextManagementResponse | UnsetType = UNSET
            if req.context_management is not None:
                with template_kwargs(enable_thinking=enable_thinking(req.thinking)):
                    managed = await self._clear_tool_uses(tenant, resolved, edit, conv)
                thinking_edit = _edit(req, ClearThinkingEdit)
                if thinking_edit is not None:
                    resolved.state, applied = await clear_thinking(self.chains, resolved.state, thinking_edit, tenant,
                                                                   self._intervals)
                    managed.applied_edits.append(applied)
            data = turn_create(conv.messages[resolved.offset:], sampling, conv.prefix, req.stream)
            with template_kwargs(enable_thinking=enable_thinking(req.thinking)):
                turn = await self.chains.start_turn(resolved.chain_id, data, tenant=tenant)
            if turn.state.num_turns != resolved.state.num_turns:
                await turn.close()
                raise ChainMoved(detail="the conversation's chain gained a turn through another route meanwhile: "
                                        "retry")
        omitted = isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)) and req.thinking.display == "omitted"
        return Pending(id=f"msg_{uuid.uuid4().hex[:24]}", turn=turn, resolved=resolved, parse_calls=parse_calls,
                       prefix=conv.prefix, stop_sequences=sampling["stop"], context_management=managed,
                       thinking=renderer.thinking(turn.prompt), show_thinking=not omitted)

    async def create(self, req: MessagesRequest, tenant: str) -> tuple[Message, Resolved]:
        pending = await self.start(req, tenant)
        try:
            result = await pending.turn.result()
        finally:
            await pending.close()
        text = result.message.content[len(pending.prefix or ""):]
        blocks = BlockWriter(pending.parse_calls, pending.prefix, pending.thinking, pending.show_thinking).whole(text)
        reason, sequence = self._stop(result, pending, blocks)
        message = Message(id=pending.id, type="message", role="assistant", content=blocks, model=self.model_name,
                          stop_reason=reason, stop_sequence=sequence, usage=usage(result, pending.resolved.imported),
                          context_management=pending.context_management)
        return message, pending.resolved

    async def events(self, pending: Pending) -> AsyncGenerator[ServerSentEventMessage, None]:
        """The SSE events of a streamed reply (Anthropic's order). An error once the stream has started is an
        ``error`` event, and the stream ends there."""
        start = Message(id=pending.id, type="message", role="assistant", content=[], model=self.model_name,
                        stop_reason=None, stop_sequence=None, usage=_expected_usage(pending))
        yield _sse(MessageStartEvent(message=start))
        writer = BlockWriter(pending.parse_calls, pending.prefix, pending.thinking, pending.show_thinking)
        try:
            result: TurnResult | None = None
            async with aclosing(pending.turn.events()) as events:
                async for event in events:
                    if isinstance(event, TurnDelta):
                        for e in writer.feed(event.text):
                            yield _sse(e)
                    else:
                        result = event
            assert result is not None
            for e in writer.finish():
                yield _sse(e)
            reason, sequence = self._stop(result, pending, writer.blocks)
            yield _sse(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                         usage=usage(result, pending.resolved.imported),
                                         context_management=pending.context_management))
            yield _sse(MessageStopEvent())
        except Exception as exc:  # the status line is sent: the error goes into the stream
            log.info("stream %s failed: %r", pending.id, exc)
            yield ServerSentEventMessage(event="error", data=msgspec.json.encode(anthropic_error_body(exc)).decode())

    async def count_tokens(self, req: CountTokensRequest, tenant: str) -> CountTokensResponse:
        """The prompt's tokens as the engine would see them: exact for a new conversation and for one that
        continues a chain's whole history; for one that does neither, the chat template's rendering of it all."""
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        check_tool_choice(req.tool_choice, req.tools)
        if req.mcp_servers:
            raise bad_field("mcp_servers", "this server connects to no MCP servers: leave it out or empty")
        renderer = self.chains.renderer
        conv = conversation(req, thinks=renderer.renderer.think is not None)
        if not conv.messages:
            raise bad_field("messages", "must hold a user message")
        found = await self.implicit.peek(tenant, conv.system, conv.tools, conv.messages)
        new = conv.messages[found[1]:] if found is not None else []
        with template_kwargs(enable_thinking=enable_thinking(req.thinking)):
            if found is not None and not any(m["role"] == "assistant" for m in new):
                state = found[0]
                new = ([state.system_message()] if state.num_turns == 0 else []) + new
                last = state.token_ids[-1] if state.token_ids else None
                appended = await renderer.append(state.history, new, state.row.tools, last, conv.prefix,
                                                log_ids=state.token_ids)
                count = len(state.token_ids) + len(appended.token_ids)
            else:
                system = {"role": "system", "content": self.config.default_system_prompt if conv.system is None
                          else conv.system}
                appended = await renderer.append([], [system, *conv.messages], conv.tools, None, conv.prefix)
                count = len(appended.token_ids)
        managed = UNSET if req.context_management is None else CountTokensContextManagement(
            original_input_tokens=count)
        return CountTokensResponse(input_tokens=count, context_management=managed)

    # --- context management -------------------------------------------------------------------------------
    async def _clear_tool_uses(self, tenant: str, resolved: Resolved, edit: ClearToolUsesEdit | None,
                               conv: Conversation) -> ContextManagementResponse:
        """``clear_tool_uses_20250919`` as pruning: once the prompt is over the trigger, the chain's oldest tool
        results (all but the ``keep`` most recent tool uses, the request's new ones counted first; tools in
        ``exclude_tools`` never) leave the KV, if that frees at least ``clear_at_least`` tokens. With
        ``clear_tool_inputs`` (true, or the tools named) the inputs of the cleared uses leave it too: the tokens
        of each ``tool_use``'s arguments in the assistant turn that made the call (``call_input_spans``), pruned
        as intervals with the results in one prune. The chain keeps the messages, so the client's next request,
        which re-sends them, still resumes it. The report counts every tool use whose result is cleared from the
        chain's KV and the tokens cleared (those results and the inputs of theirs cleared too), as a stateless
        server would report the edit on the re-sent history."""
        state = resolved.state
        if edit is not None:
            excluded = set(edit.exclude_tools or [])
            results = [r for r in state.regions if r.kind == "tool_result"]
            new_uses = [m for m in conv.messages[resolved.offset:] if m["role"] == "tool"]
            trigger = edit.trigger or InputTokens(value=DEFAULT_TRIGGER_TOKENS)
            keep = (edit.keep or ToolUses(value=DEFAULT_KEEP_TOOL_USES)).value
            clearable = [r for r in results if r.tool_name not in excluded]
            kept_here = max(0, keep - sum(1 for m in new_uses if m.get("name") not in excluded))
            due = [r for r in clearable[:max(0, len(clearable) - kept_here)] if not r.pruned]
            # the inputs of every use cleared once this edit has run, not cleared yet (a use whose result an
            # earlier request cleared without clear_tool_inputs included)
            cleared = {r.index for r in due} | {r.index for r in results if r.pruned}
            inputs = [r for r in results if r.index in cleared and _clears_input(edit, r.tool_name)]
            spans = self._input_spans(state, conv, resolved.offset, inputs)
            pruned = [(int(a), int(b)) for a, b in state.row.pruned_intervals or []]
            due_inputs = [span for span in spans.values() if not covered(span, pruned)]
            freed = sum(r.end - r.start for r in due) + sum(hi - lo for lo, hi in due_inputs)
            at_least = edit.clear_at_least.value if edit.clear_at_least is not None else 0
            if ((due or due_inputs) and freed >= at_least
                    and await self._triggered(trigger, state, conv, resolved, len(results))):
                if due_inputs:
                    intervals = await self._intervals(state, [(r.start, r.end) for r in due] + due_inputs)
                    request = PruneRequest(intervals=intervals) if intervals else None
                else:
                    request = PruneRequest(regions=[r.index for r in due])
                if request is not None:
                    await self.chains.prune(state.id, request, tenant=tenant)
                    state = await self.chains.state(state.id, tenant)
                    resolved.state = state
        applied: list[ClearToolUsesApplied] = []
        cleared_results = [r for r in state.regions if r.kind == "tool_result" and r.pruned]
        if edit is not None and cleared_results:
            tokens = sum(r.end - r.start for r in cleared_results)
            touched = {r.turn for r in state.regions if r.kind == "assistant" and r.kept_tokens < r.end - r.start}
            if touched:  # some assistant turn lost tokens: the inputs of the cleared uses among them
                pruned = [(int(a), int(b)) for a, b in state.row.pruned_intervals or []]
                spans = self._input_spans(state, conv, resolved.offset, cleared_results, touched)
                tokens += sum(hi - lo for lo, hi in spans.values() if covered((lo, hi), pruned))
            applied.append(ClearToolUsesApplied(cleared_tool_uses=len(cleared_results), cleared_input_tokens=tokens))
        return ContextManagementResponse(applied_edits=applied)

    def _input_spans(self, state: Any, conv: Conversation, offset: int, results: list[Any],
                     turns: set[int] | None = None) -> dict[str, tuple[int, int]]:
        """tool_use id -> the token span, in the chain's log, of the arguments of the call that the tool-result
        regions ``results`` answer (only calls made in ``turns``, when given). The request's messages before
        ``offset`` are the chain's history message for message (the chain was resolved on them), so the k-th
        assistant message is turn k, and its j-th ``tool_use`` the j-th call in that turn's region; a call whose
        name or arguments read there differ from the message's is left out (never cleared)."""
        calls: dict[str, tuple[int, int, int, dict[str, Any]]] = {}  # id -> (turn, place, the turn's calls, call)
        turn = 0
        for m in conv.messages[:offset]:
            if m["role"] != "assistant":
                continue
            made = m.get("tool_calls") or []
            for j, call in enumerate(made):
                calls.setdefault(call["id"], (turn, j, len(made), call))
            turn += 1
        wanted: dict[int, list[str]] = {}
        for r in results:
            found = calls.get(r.tool_call_id)
            if found is not None and (turns is None or found[0] in turns):
                wanted.setdefault(found[0], []).append(r.tool_call_id)
        regions = {r.turn: r for r in state.regions if r.kind == "assistant"}
        decode = self.chains.renderer.renderer.decode
        spans: dict[str, tuple[int, int]] = {}
        for k, ids in wanted.items():
            region = regions.get(k)
            if region is None:
                continue
            tokens = state.token_ids[region.start:region.end]
            key = (state.id, region.index, region.start, hash(tuple(tokens)))  # a rewound turn's differ
            read = self._reads.pop(key, None)
            if read is None:
                read = call_input_spans(decode, tokens)
            self._reads[key] = read  # the most recently read last
            while len(self._reads) > READS_KEPT:
                self._reads.pop(next(iter(self._reads)))
            for tool_use_id in ids:
                _, j, n, call = calls[tool_use_id]
                if len(read) < n:  # the turn's calls are its last well-formed blocks (its reasoning's come first)
                    continue
                seen = read[len(read) - n + j]
                if seen is None or seen[0] != call["function"]["name"] or \
                        seen[1] != arguments_value(call["function"]["arguments"]):
                    continue
                spans[tool_use_id] = (region.start + seen[2], region.start + seen[3])
        return spans

    async def _intervals(self, state: Any, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The spans merged, within the chain's computed KV (the whole log when the engine does not hold it)."""
        try:
            info = await self.chains.worker.call(lambda e: e.chain_info(state.id), chain=state.id)
            limit = info.computed_tokens
        except InvalidRequestError:  # the engine does not hold the chain: the prune is a no-op
            limit = len(state.token_ids)
        return merged([(lo, min(hi, limit)) for lo, hi in spans])

    async def _triggered(self, trigger: InputTokens | ToolUses, state: Any, conv: Conversation, resolved: Resolved,
                         in_chain: int) -> bool:
        new = conv.messages[resolved.offset:]
        if isinstance(trigger, ToolUses):
            return in_chain + sum(1 for m in new if m["role"] == "tool") > trigger.value
        last = state.token_ids[-1] if state.token_ids else None
        appended = await self.chains.renderer.append(state.history, new, state.row.tools, last, conv.prefix,
                                                     log_ids=state.token_ids)
        return len(state.token_ids) + len(appended.token_ids) > trigger.value

    # --- the reply -------------------------------------------------------------------------------------------
    def _stop(self, result: TurnResult, pending: Pending, blocks: list[ContentBlock]) -> tuple[StopReason, str | None]:
        if result.finish_reason == "length":
            return "max_tokens", None
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            return "tool_use", None
        if pending.stop_sequences:
            sequence = self._stop_sequence(result, pending)
            if sequence is not None:
                return "stop_sequence", sequence
        return "end_turn", None

    def _stop_sequence(self, result: TurnResult, pending: Pending) -> str | None:
        """The stop sequence that ended the reply (None when an end-of-turn token did): the engine cuts the text
        where the sequence starts; the chain's log keeps the tokens that spelled it."""
        state = self.chains.states.get(result.chain_id)
        n = result.usage.completion_tokens
        generated = state.token_ids[-n:] if state is not None and n else []
        renderer = self.chains.renderer.renderer
        if generated and generated[-1] in renderer.stop_token_ids:
            return None
        text = result.message.content[len(pending.prefix or ""):]
        full = renderer.decode(generated)
        found = [s for s in pending.stop_sequences if full.startswith(s, len(text))]
        found = found or [s for s in pending.stop_sequences if s in full[max(0, len(text) - len(s) + 1):]]
        return min(found) if found else None


def usage(result: TurnResult, imported: list[TurnResult]) -> Usage:
    """``input_tokens``: the prompt tokens this request computed (its turns' prefills: the new part, plus the
    token the chain's KV lacks, its last generated one); ``cache_read_input_tokens``: the rest of the prompt,
    reused (resumed from the chain, or from the prefix cache)."""
    computed = result.usage.prefilled_tokens + sum(t.usage.prefilled_tokens for t in imported)
    return Usage(input_tokens=computed, output_tokens=result.usage.completion_tokens,
                 cache_read_input_tokens=max(0, result.usage.prompt_tokens - computed))


def _expected_usage(pending: Pending) -> Usage:
    """message_start's usage, before the engine has run: what a resumed chain would reuse (message_delta carries
    the counts)."""
    turn, imported = pending.turn, pending.resolved.imported
    resumable = max(0, len(turn.state.token_ids) - 1) if turn.state.num_turns else 0
    computed = len(turn.prompt) - resumable + sum(t.usage.prefilled_tokens for t in imported)
    return Usage(input_tokens=computed, output_tokens=0,
                 cache_read_input_tokens=max(0, len(turn.prompt) - computed))


def _sse(event: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=event.__struct_config__.tag, data=msgspec.json.encode(event).decode())


def chain_headers(resolved: Resolved) -> dict[str, str]:
    """Which chain served the request, and how it was found: for operators and tests (the chain routes read it
    with the same key)."""
    return {"agentrt-chain-id": resolved.chain_id, "agentrt-chain-resolution": resolved.how}


def messages_service(state: State) -> MessagesService:
    """The app's MessagesService, made on first use from what the lifespan put on ``app.state``."""
    service = getattr(state, "anthropic_messages", None)
    if service is None:
        service = MessagesService(state.chains, implicit_chains_of(state), state.model_name, state.config)
        state.anthropic_messages = service
    return service
