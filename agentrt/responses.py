"""OpenAI's Responses API over chains (docs/responses.md).

A response is one chain turn. Which chain:

- Without ``previous_response_id``, with ``ServerConfig.implicit_chains`` on (the default): the request is a
  whole conversation, as stateless clients send it (``store: false``, the history re-sent as ``input`` items on
  every request), and goes through the tenant's implicit chains (agentrt.implicit_chains), as chat completions
  and Anthropic's Messages do. ``instructions`` and the leading ``system`` / ``developer`` items (joined by a
  newline) are the system prompt, ``tools`` the tools; the items become the chain routes' messages: a user
  ``message`` a user message, consecutive assistant ``message`` and ``function_call`` items one assistant
  message (the ``output_text`` joined, each call with its ``call_id``, name and arguments as a tool call), a
  ``function_call_output`` a tool message (named after the ``function_call`` it answers, which must precede it),
  a ``reasoning`` item nothing (the chain holds the reasoning as generated). The tenant's chain whose history
  is the longest prefix of those messages, among the chains of the same session (``prompt_cache_key``, else
  ``user``, else ``safety_identifier``; none: a session of its own), is resumed (or forked), and only the
  rest is prefilled; a conversation not seen before becomes a new implicit chain (history it lacks imported).
  A tenant at its chain limit gets a 429, as for any new conversation (there is no stateless path here).
- Without ``previous_response_id``, implicit chains off: a new chain per request (``{"agentrt_responses":
  true}`` in its metadata), the items converted the same way; earlier assistant items are imported as turns of
  the new chain (as implicit chains import history), then the rest is the response's turn.
- With the id of the chain's latest response: the new input items are one more turn of that chain (only they
  are prefilled: the chain's KV is resumed); with the id of an older response the chain is forked and the fork
  rewound to that response's turn, then the turn is appended there. Assistant ``message`` and ``function_call``
  items may only echo the previous response's output (skipped: the chain holds them).
- With ``conversation`` (agentrt.conversations; not with ``previous_response_id``): the next turn of the
  conversation's chain, its pending items (then the request's items) its messages; added assistant items are
  imported first, one turn each. The output's item ids are the conversation's (``msg_<key>``, ...). On the
  conversation's first turn ``instructions`` and ``tools`` set the chain's system prompt and tools; later ones must
  repeat them or leave them out.

Each response is a database row written with its chain turn, so GET, DELETE, input_items and
``previous_response_id`` outlive a restart (agentrt.responses_store). The request becomes the chain routes'
messages, tools and sampling in agentrt.responses_input; the output items, the finished response and the stream's
events are agentrt.responses_events. ``reasoning.effort`` ("none": off, another level: on) is the chat template's
``enable_thinking``.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from litestar.datastructures import State
from litestar.response import ServerSentEventMessage

from agentrt.anthropic_messages import ChainMoved
from agentrt.chains import no_nul
from agentrt.chat import template_kwargs
from agentrt.completions_input import REASONING_EFFORTS
from agentrt.conversations import ConversationService, TurnPlan, conversations_service
from agentrt.conversations_items import output_ids
from agentrt.errors import ModelNotFound, bad_field
from agentrt.implicit_chains import implicit_chains_for
from agentrt.models import ResponseRow
from agentrt.responses_events import (Pending, finished_response, new_id, output_items, reasoning_tokens,
                                      response_tool)
from agentrt.responses_events import events as stream_events
from agentrt.responses_input import (Conversation, continued_messages, conversation_id, convert, effort,
                                     max_output_tokens, request_items, request_sampling, request_tools, thinking,
                                     turn_create, whole_conversation)
from agentrt.responses_store import Record, ResponseStore
from agentrt.responses_types import InputItem, InputItemList, ResponseConversation, ResponseObject, ResponsesRequest
from sdk.schema import ChainCreate, ForkRequest, RewindRequest, Tool, TurnResult

log = logging.getLogger(__name__)
METADATA = {"agentrt_responses": True}


class ResponseService:
    def __init__(self, chains: Any, model_name: str, config: Any, conversations: ConversationService | None = None):
        self.chains = chains
        self.model_name = model_name
        self.config = config
        self.store = ResponseStore(chains)  # the response rows and their cache
        self.conversations = conversations if conversations is not None else ConversationService(chains)

    @property
    def records(self) -> OrderedDict[str, Record]:
        """The cache of the response rows (agentrt.responses_store)."""
        return self.store.records

    # --- the request --------------------------------------------------------------------------------------
    def _refuse(self, req: ResponsesRequest) -> None:
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        if req.background:
            raise bad_field("background", "this server runs responses in the foreground only")
        for name in ("prompt", "top_logprobs"):
            if getattr(req, name) is not None:
                raise bad_field(name, "not supported by this server: leave it out")
        if req.truncation not in (None, "disabled"):
            raise bad_field("truncation", "only 'disabled': a chain is never truncated")
        forced = req.forced_token_ids or []
        vocab = self.chains.worker.engine.model_config.vocab_size
        if len(forced) > self._max_tokens(req):
            raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_output_tokens")
        if any(t >= vocab for t in forced):
            raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        if self.chains.renderer.renderer.think is not None and effort(req) not in (None, *REASONING_EFFORTS):
            raise bad_field("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORTS)} (\"none\": no "
                                                "thinking; any other level turns thinking on)")

    def _max_tokens(self, req: ResponsesRequest) -> int:
        return max_output_tokens(req, self.config.max_tokens_per_turn)

    async def _start_implicit(self, req: ResponsesRequest, tenant: str, conv: Conversation,
                              tools: list[dict[str, Any]], sampling: dict[str, Any]
                              ) -> tuple[Any, list[TurnResult]]:
        """A turn of the tenant's implicit chain holding the longest prefix of the conversation (resumed, forked
        or created: agentrt.implicit_chains), scoped by ``prompt_cache_key``, else ``user`` /
        ``safety_identifier``: the pending turn and the history turns imported for it. A chain made for the
        request is deleted again if the turn does not start."""
        session = req.prompt_cache_key or req.user or req.safety_identifier
        implicit = implicit_chains_for(self.chains)
        async with implicit.resolve(tenant, session, conv.system, tools, conv.messages, conv.names) as resolved:
            data = turn_create(req, conv.messages[resolved.offset:], sampling)
            with template_kwargs(enable_thinking=thinking(req)):
                turn = await self.chains.start_turn(resolved.chain_id, data, tenant=tenant)
            if turn.state.num_turns != resolved.state.num_turns:
                await turn.close()
                raise ChainMoved(detail="the conversation's chain gained a turn through another route meanwhile: "
                                        "retry")
        return turn, resolved.imported

    async def _start_new(self, req: ResponsesRequest, tenant: str, conv: Conversation,
                         tools: list[dict[str, Any]], sampling: dict[str, Any]) -> tuple[Any, list[TurnResult]]:
        """Implicit chains off: a new chain; the conversation's earlier assistant messages imported as its first
        turns (as implicit chains import history), then the response's turn. The chain is deleted again if the
        turn does not start."""
        data = convert({"system_prompt": conv.system, "tools": tools, "metadata": METADATA}, ChainCreate, "tools")
        chain = await self.chains.create(data, tenant=tenant)
        try:
            imported: list[TurnResult] = []
            offset = 0
            if any(m["role"] == "assistant" for m in conv.messages):
                imported, offset = await implicit_chains_for(self.chains).import_history(
                    tenant, chain.id, conv.messages, 0, conv.names)
            turn_data = turn_create(req, conv.messages[offset:], sampling)
            with template_kwargs(enable_thinking=thinking(req)):
                turn = await self.chains.start_turn(chain.id, turn_data, tenant=tenant)
        except BaseException:
            await self._discard(chain.id, tenant)
            raise
        return turn, imported

    async def _start_continued(self, req: ResponsesRequest, tenant: str, items: list[InputItem],
                               tools: list[dict[str, Any]] | None, sampling: dict[str, Any],
                               previous: Record | None) -> Any:
        """With ``previous_response_id`` (``previous``: its record, None when there is none for the tenant): a
        turn of its chain, or of a fork rewound to its turn (an older response; the fork is deleted again if the
        turn does not start)."""
        if previous is None:
            raise bad_field("previous_response_id", f"no response with the id {req.previous_response_id!r}",
                            code="previous_response_not_found")
        state = await self.chains.state(previous.chain_id, tenant)
        if req.instructions is not None and req.instructions != state.row.system_prompt:
            raise bad_field("instructions", "differs from the conversation's (the chain's system prompt is "
                                            "fixed): leave it out or repeat it")
        if tools is not None and tools != state.row.tools:
            raise bad_field("tools", "differ from the conversation's (the chain renders its tools once): "
                                     "leave them out or repeat them")
        messages = continued_messages(items, 0, previous.response)
        chain_id, forked = previous.chain_id, False
        if state.num_turns != previous.turn + 1:  # an older response: branch there
            fork = await self.chains.fork(chain_id, ForkRequest(metadata=METADATA), tenant=tenant)
            chain_id, forked = fork.id, True
        try:
            if forked:
                await self.chains.rewind(chain_id, RewindRequest(num_turns=previous.turn + 1), tenant=tenant)
            data = turn_create(req, messages, sampling)
            with template_kwargs(enable_thinking=thinking(req)):
                return await self.chains.start_turn(chain_id, data, tenant=tenant)
        except BaseException:
            if forked:
                await self._discard(chain_id, tenant)
            raise

    async def _start_conversation(self, req: ResponsesRequest, tenant: str, plan: TurnPlan,
                                  tools: list[dict[str, Any]] | None, sampling: dict[str, Any]
                                  ) -> tuple[Any, list[TurnResult]]:
        """The conversation's next turn (agentrt.conversations.plan): its item ids recorded, any added assistant
        items imported as turns, then the response's turn. On its first turn ``instructions`` (before the text
        of the system items it was created with) and ``tools`` become the chain's."""
        try:
            state = plan.state
            first = state.num_turns == 0
            chain_tools = None if tools is None else msgspec.to_builtins(convert(tools, list[Tool], "tools"))
            row: dict[str, Any] = {}
            if first:
                parts = ([req.instructions] if req.instructions is not None else []) + plan.system_texts
                system = "\n".join(parts) if parts else self.config.default_system_prompt
                no_nul(req.instructions, "instructions")
                convert({"system_prompt": system}, ChainCreate, "instructions")
                row = {"system_prompt": system, "tools": chain_tools or []}
                if row == {"system_prompt": state.row.system_prompt, "tools": state.row.tools}:
                    row = {}
            else:
                if req.instructions is not None and req.instructions != plan.instructions:
                    raise bad_field("instructions", "differs from the conversation's first response's (the chain's "
                                                    "system prompt is fixed): leave it out or repeat it")
                if chain_tools is not None and chain_tools != state.row.tools:
                    raise bad_field("tools", "differ from the conversation's (the chain renders its tools once): "
                                             "leave them out or repeat them")
            data = turn_create(req, plan.messages[plan.offset:], sampling)
            await self.conversations.record(plan, first, req.instructions, **row)
            imported: list[TurnResult] = []
            if plan.offset:
                imported, _ = await implicit_chains_for(self.chains).import_history(
                    tenant, state.id, plan.messages, 0, plan.names)
            with template_kwargs(enable_thinking=thinking(req)):
                turn = await self.chains.start_turn(state.id, data, tenant=tenant)
        finally:
            self.conversations.release(plan)
        return turn, imported

    async def _discard(self, chain_id: str, tenant: str) -> None:
        try:
            await self.chains.delete(chain_id, tenant=tenant)
        except Exception:  # the request's own error is what the client gets
            log.exception("could not delete chain %s", chain_id)

    async def start(self, req: ResponsesRequest, tenant: str) -> Pending:
        self._refuse(req)
        items = request_items(req)
        tools = request_tools(req)
        given_tools = tools
        conversation = conversation_id(req)
        if conversation is not None and req.previous_response_id is not None:
            raise bad_field("previous_response_id", "cannot be given with `conversation`: the conversation's "
                                                    "next turn follows its last (give one of them)")
        previous = None
        if req.previous_response_id is not None:
            previous = await self.store.record(req.previous_response_id, tenant)
        if previous is not None and tools is None:
            tools = (await self.chains.state(previous.chain_id, tenant)).row.tools
        elif conversation is not None and tools is None:
            tools = (await self.conversations.state(conversation, tenant)).row.tools
        sampling, parse_calls = request_sampling(req, tools or [], self._max_tokens(req))
        imported: list[TurnResult] = []
        item_ids: list[str | None] = []
        item_key = None
        if req.previous_response_id is not None:
            turn = await self._start_continued(req, tenant, items, tools, sampling, previous)
        elif conversation is not None:
            plan = await self.conversations.plan(conversation, tenant, items, parse_calls)
            turn, imported = await self._start_conversation(req, tenant, plan, given_tools, sampling)
            item_ids, item_key = plan.input_ids, plan.key
        else:
            conv = whole_conversation(req, items)
            tools = msgspec.to_builtins(convert(tools or [], list[Tool], "tools"))
            start = self._start_implicit if self.config.implicit_chains else self._start_new
            turn, imported = await start(req, tenant, conv, tools, sampling)
        state = turn.state
        stored = req.store is not False
        input_items = [{**msgspec.to_builtins(it), "id": (item_ids[i] if i < len(item_ids) else None)
                        or getattr(it, "id", None) or new_id("item")}
                       for i, it in enumerate(items)] if stored else []  # never read back when not stored
        record = Record(tenant=tenant, chain_id=state.id, turn=state.num_turns, stored=stored)
        response = ResponseObject(
            id=new_id("resp"), created_at=int(time.time()), model=self.model_name, status="in_progress", output=[],
            instructions=state.row.system_prompt, tools=[response_tool(t) for t in state.row.tools],
            tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=sampling["temperature"],
            top_p=sampling["top_p"], max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, metadata=req.metadata or {},
            text=msgspec.to_builtins(req.text) if req.text is not None and req.text.format is not None
            else {"format": {"type": "text"}}, store=stored,
            conversation=ResponseConversation(id=conversation) if conversation is not None else None)
        reasoning_id, message_id = output_ids(item_key) if item_key is not None else (new_id("rs"), new_id("msg"))
        calls = self.chains.renderer.reader(state.row.tools) if parse_calls else None
        pending = Pending(response=response, record=record, turn=turn, calls=calls,
                          input_items=input_items, thinking=self.chains.renderer.renderer.thinking(turn.prompt),
                          imported=imported, item_key=item_key, message_id=message_id, reasoning_id=reasoning_id)
        turn.extra_rows = lambda result, generated: self._rows(pending, result, generated)
        return pending

    # --- the response -------------------------------------------------------------------------------------
    def _rows(self, pending: Pending, result: TurnResult, generated: list[int]) -> list[ResponseRow]:
        """The response's row, written in the transaction that commits its turn (``PendingTurn.extra_rows``);
        the finished response becomes ``pending.done``."""
        think = self.chains.renderer.renderer.think
        response = finished_response(pending, result, output_items(result, pending),
                                     reasoning_tokens(pending, result, generated, think))
        record = pending.record
        record.chain_id, record.turn, record.response = result.chain_id, result.turn, response
        pending.done = response
        return [ResponseRow(id=response.id, tenant=record.tenant, chain_id=record.chain_id, turn=record.turn,
                            stored=record.stored, created_at=time.time(), response=msgspec.to_builtins(response),
                            input_items=pending.input_items)]

    def _finish(self, pending: Pending) -> ResponseObject:
        """The response of the committed turn (made with its row), now cached."""
        response = pending.done
        assert response is not None, "the turn committed without its response row"
        self.store.remember(response.id, pending.record)
        return response

    async def create(self, req: ResponsesRequest, tenant: str) -> ResponseObject:
        pending = await self.start(req, tenant)
        try:
            await pending.turn.result()
        finally:
            await pending.turn.close()
        return self._finish(pending)

    def events(self, pending: Pending) -> AsyncGenerator[ServerSentEventMessage, None]:
        """A streamed response's events (agentrt.responses_events)."""
        return stream_events(pending, self._finish)

    # --- stored responses (agentrt.responses_store) ------------------------------------------------------------
    async def get(self, response_id: str, tenant: str) -> ResponseObject:
        return await self.store.get(response_id, tenant)

    async def delete(self, response_id: str, tenant: str) -> None:
        """The response is forgotten (its chain and turn stay: they belong to the chain API)."""
        await self.store.delete(response_id, tenant)

    async def input_items(self, response_id: str, tenant: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> InputItemList:
        return await self.store.input_items(response_id, tenant, order, limit, after)


def responses_service(state: State) -> ResponseService:
    service = getattr(state, "responses", None)
    if service is None:
        service = ResponseService(state.chains, state.model_name, state.config, conversations_service(state))
        state.responses = service
    return service
