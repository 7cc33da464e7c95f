"""Anthropic's Messages API over implicit chains (agentrt.implicit_chains).

A request carries the whole conversation. Its messages become the chain routes' messages (agentrt.anthropic_input),
the conversation's chain is resolved (resumed, forked or created; earlier history the chain lacks imported), the
request's ``context_management`` edits run on it as pruning (agentrt.clear_tool_uses, agentrt.clear_thinking), and
the new messages become one chain turn. The reply's content blocks, its usage and the stream's events are
agentrt.anthropic_events.

``tool_choice`` ``any`` / ``tool`` become the turn's ``sampling.tool_choice`` (``required`` / the named function;
docs/structured-outputs.md), so constrained decoding makes the reply those calls and nothing else. A model that
thinks (agentrt.reasoning) has its think block as a ``thinking`` block first; the request's ``thinking`` is the chat
template's ``enable_thinking`` (``enabled``: on, ``disabled``: off, ``adaptive`` or none: the template's default).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import ServerSentEventMessage
from msgspec import UNSET, UnsetType

from agentrt.anthropic_events import BlockWriter, Pending, usage
from agentrt.anthropic_events import events as stream_events
from agentrt.anthropic_input import check_tool_choice, context_edit, conversation, enable_thinking
from agentrt.anthropic_types import (ClearThinkingEdit, ClearToolUsesEdit, ContentBlock, ContextManagementResponse,
                                     CountTokensContextManagement, CountTokensRequest, CountTokensResponse, Message,
                                     MessagesRequest, StopReason, ThinkingAdaptive, ThinkingEnabled, ToolUseBlock)
from agentrt.chat import template_kwargs
from agentrt.clear_thinking import clear_thinking
from agentrt.clear_tool_uses import ToolUseClearing
from agentrt.errors import ModelNotFound, bad_field
from agentrt.implicit_chains import ImplicitChains, Resolved, implicit_chains_of, turn_create
from engine.structured_output import schema_error
from sdk.schema import TurnResult

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from agentrt.config import ServerConfig


class ChainMoved(HTTPException):
    """The resolved chain gained a turn through another route before this request's turn started (retryable:
    the next resolution sees the new history)."""

    status_code = 409


class MessagesService:
    def __init__(self, chains: ChainService, implicit: ImplicitChains, model_name: str, config: ServerConfig):
        self.chains = chains
        self.implicit = implicit
        self.model_name = model_name
        self.config = config
        self.tool_uses = ToolUseClearing(chains)  # the clear_tool_uses edit

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
        edit = context_edit(req, ClearToolUsesEdit)
        renderer = self.chains.renderer.renderer
        conv = conversation(req, thinks=renderer.think is not None)
        session = req.metadata.user_id if req.metadata is not None else None
        async with self.implicit.resolve(tenant, session, conv.system, conv.tools, conv.messages,
                                         conv.names) as resolved:
            managed: ContextManagementResponse | UnsetType = UNSET
            if req.context_management is not None:
                with template_kwargs(enable_thinking=enable_thinking(req.thinking)):
                    managed = await self.tool_uses.clear(tenant, resolved, edit, conv)
                thinking_edit = context_edit(req, ClearThinkingEdit)
                if thinking_edit is not None:
                    resolved.state, applied = await clear_thinking(self.chains, resolved.state, thinking_edit, tenant,
                                                                   self.tool_uses.intervals)
                    managed.applied_edits.append(applied)
            data = turn_create(conv.messages[resolved.offset:], sampling, conv.prefix, req.stream)
            with template_kwargs(enable_thinking=enable_thinking(req.thinking)):
                turn = await self.chains.start_turn(resolved.chain_id, data, tenant=tenant)
            if turn.state.num_turns != resolved.state.num_turns:
                await turn.close()
                raise ChainMoved(detail="the conversation's chain gained a turn through another route meanwhile: "
                                        "retry")
        omitted = isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)) and req.thinking.display == "omitted"
        calls = self.chains.renderer.reader(conv.tools) if parse_calls else None
        return Pending(id=f"msg_{uuid.uuid4().hex[:24]}", turn=turn, resolved=resolved, calls=calls,
                       prefix=conv.prefix, stop_sequences=sampling["stop"], context_management=managed,
                       thinking=renderer.thinking(turn.prompt), show_thinking=not omitted)

    async def create(self, req: MessagesRequest, tenant: str) -> tuple[Message, Resolved]:
        pending = await self.start(req, tenant)
        try:
            result = await pending.turn.result()
        finally:
            await pending.close()
        text = result.message.content[len(pending.prefix or ""):]
        blocks = BlockWriter(pending.calls, pending.prefix, pending.thinking, pending.show_thinking).whole(text)
        reason, sequence = self._stop(result, pending, blocks)
        message = Message(id=pending.id, type="message", role="assistant", content=blocks, model=self.model_name,
                          stop_reason=reason, stop_sequence=sequence, usage=usage(result, pending.resolved.imported),
                          context_management=pending.context_management)
        return message, pending.resolved

    def events(self, pending: Pending) -> AsyncGenerator[ServerSentEventMessage, None]:
        """A streamed reply's events (agentrt.anthropic_events)."""
        return stream_events(pending, self.model_name, self._stop)

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
