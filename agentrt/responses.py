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

The map response -> (chain, turn) lives in this process (``ResponseService.records``), for every response, of
an implicit chain too: a later ``previous_response_id`` continues it. After a restart the responses are gone
(404) while their chains, KV and turns stay readable over the chain API (implicit chains are still found by
the next request that re-sends their conversation). ``store: false``: the response is not retrievable (GET /
DELETE / input_items answer 404; its input items are not kept) but it can still be continued with
``previous_response_id``, and its chain keeps its KV.

``usage.input_tokens_details.cached_tokens``: the prompt tokens this request did not compute (the turn's
prompt less its prefill and the prefill of any history imported for it).

The output is one ``message`` item holding the reply's text without its tool-call markup (when there is any
text), then one ``function_call`` item per call, with the chain's call ids. A stream sends the text as it is
released (agentrt.tool_call_stream) and the calls once the turn has ended, so its items equal the
non-streamed ones. A model that thinks (agentrt.reasoning) has its think block as a ``reasoning`` item first
(``content: [{"type": "reasoning_text", "text"}]``, streamed as ``response.reasoning_text.delta`` events);
``reasoning.effort`` ("none": off, another level: on) is the chat template's ``enable_thinking``.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.response import ServerSentEventMessage

from agentrt.anthropic_messages import ChainMoved
from agentrt.chains import no_nul
from agentrt.chat import Message, calls_in, template_kwargs, without_calls
from agentrt.completions import REASONING_EFFORTS
from agentrt.conversations import ConversationService, TurnPlan, call_item_id, conversations_service, output_ids
from agentrt.errors import ModelNotFound, bad_field, openai_error_body
from agentrt.implicit_chains import implicit_chains_for
from agentrt.reasoning import ReasoningParser, split_reasoning
from agentrt.reasoning import parser as reasoning_parser
from agentrt.responses_types import (FunctionCallItem, FunctionCallOutputItem, FunctionTool, IncompleteDetails,
                                     InputItem, InputItemList, InputTokensDetails, MessageItem,
                                     OutputFunctionCall, OutputMessage, OutputReasoning, OutputText, OutputTextPart,
                                     OutputTokensDetails, ReasoningItem, ReasoningTextPart, ResponseConversation,
                                     ResponseObject, ResponsesRequest, ResponseUsage, ToolChoiceFunction)
from agentrt.tool_call_stream import ToolCallStream
from engine.structured_output import schema_error
from sdk.schema import ChainCreate, ForkRequest, RewindRequest, Tool, TurnCreate, TurnDelta, TurnMessage, TurnResult

log = logging.getLogger(__name__)
METADATA = {"agentrt_responses": True}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ResponseNotFound(NotFoundException):
    def __init__(self, response_id: str):
        super().__init__(detail=f"no response with the id {response_id!r}")


@dataclass(slots=True)
class Record:
    tenant: str
    chain_id: str
    turn: int  # the chain turn's index (the chain has turn + 1 turns right after it)
    stored: bool
    input_items: list[dict[str, Any]]
    response: ResponseObject | None = None


@dataclass(slots=True)
class Pending:
    response: ResponseObject
    record: Record
    turn: Any  # agentrt.turns.PendingTurn
    parse_calls: bool
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    imported: list[TurnResult] = field(default_factory=list)  # history turns this request appended first
    item_key: str | None = None  # a conversation's turn: its output item ids (agentrt.conversations.output_ids)
    seq: int = 0
    items: list[Any] = field(default_factory=list)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


@dataclass(slots=True)
class Conversation:
    """A request without ``previous_response_id`` as a whole conversation: the chain routes' messages."""

    system: str | None  # instructions and the leading system / developer items; None: the server's default
    messages: list[Message]
    names: list[str]  # the input field of each message (an assistant message's: its first item), for errors


def _convert(value: Any, kind: Any, key: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


class ResponseService:
    def __init__(self, chains: Any, model_name: str, config: Any, conversations: ConversationService | None = None):
        self.chains = chains
        self.model_name = model_name
        self.config = config
        self.records: dict[str, Record] = {}
        self.conversations = conversations if conversations is not None else ConversationService(chains)

    # --- the request --------------------------------------------------------------------------------------
    def _items(self, req: ResponsesRequest) -> list[InputItem]:
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
            items.append(_convert({"type": "message", **raw}, InputItem, f"input[{i}]"))
        return items

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
        if req.max_output_tokens is not None and req.max_output_tokens > self.config.max_tokens_per_turn:
            raise bad_field("max_output_tokens", f"must be <= {self.config.max_tokens_per_turn}")
        forced = req.forced_token_ids or []
        vocab = self.chains.worker.engine.model_config.vocab_size
        if len(forced) > (req.max_output_tokens or self.config.max_tokens_per_turn):
            raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_output_tokens")
        if any(t >= vocab for t in forced):
            raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        if self.chains.renderer.renderer.think is not None and _effort(req) not in (None, *REASONING_EFFORTS):
            raise bad_field("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORTS)} (\"none\": no "
                                                "thinking; any other level turns thinking on)")

    def _tools(self, req: ResponsesRequest) -> list[dict[str, Any]] | None:
        """The chain routes' form of the request's tools (None when left out)."""
        if req.tools is None:
            return None
        tools = []
        for i, raw in enumerate(req.tools):
            if raw.get("type") != "function":
                raise bad_field(f"tools[{i}].type", f"only function tools, not {raw.get('type')!r}")
            t = _convert(raw, FunctionTool, f"tools[{i}]")
            function = {"name": t.name, **({"description": t.description} if t.description else {}),
                        **({"parameters": t.parameters} if t.parameters is not None else {})}
            tools.append({"type": "function", "function": function})
        return tools

    def _sampling(self, req: ResponsesRequest, tools: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        greedy = req.top_p == 0
        sampling: dict[str, Any] = {
            "temperature": 0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None or greedy else req.top_p,
            "max_tokens": req.max_output_tokens or self.config.max_tokens_per_turn}
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

    def _conversation(self, req: ResponsesRequest, items: list[InputItem]) -> Conversation:
        """The items of a request without ``previous_response_id`` as a whole conversation (module docstring): a
        400 naming the item where one cannot be part of it."""
        system_parts = [req.instructions] if req.instructions is not None else []
        start = 0
        while start < len(items) and isinstance(items[start], MessageItem) and \
                items[start].role in ("system", "developer"):
            system_parts.append(_text(items[start].content))
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
                    messages[-1]["content"] += _text(item.content)
                continue
            if isinstance(item, FunctionCallOutputItem):
                if item.call_id not in called:
                    raise bad_field(f"{key}.call_id", f"no function_call item with the call_id {item.call_id!r} "
                                                      "precedes it in the input")
                message: Message = {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id,
                                    "name": called[item.call_id]}
            elif item.role in ("system", "developer"):
                raise bad_field(f"{key}.role", "system and developer messages may only open the conversation "
                                               "(they become the chain's system prompt with `instructions`)")
            else:
                if not isinstance(item.content, str) and any(isinstance(p, OutputText) for p in item.content):
                    raise bad_field(f"{key}.content", "a user message takes input_text parts")
                message = {"role": "user", "content": _text(item.content)}
            _convert(message, TurnMessage, key)  # the turn's limits, named here
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

    def _turn(self, req: ResponsesRequest, messages: list[Message], sampling: dict[str, Any]) -> TurnCreate:
        return _convert({"messages": messages, "sampling": sampling, "stream": bool(req.stream)}, TurnCreate,
                        "input")

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
            data = self._turn(req, conv.messages[resolved.offset:], sampling)
            with template_kwargs(enable_thinking=_thinking(req)):
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
        data = _convert({"system_prompt": conv.system, "tools": tools, "metadata": METADATA}, ChainCreate, "tools")
        chain = await self.chains.create(data, tenant=tenant)
        try:
            imported: list[TurnResult] = []
            offset = 0
            if any(m["role"] == "assistant" for m in conv.messages):
                imported, offset = await implicit_chains_for(self.chains).import_history(
                    tenant, chain.id, conv.messages, 0, conv.names)
            turn_data = self._turn(req, conv.messages[offset:], sampling)
            with template_kwargs(enable_thinking=_thinking(req)):
                turn = await self.chains.start_turn(chain.id, turn_data, tenant=tenant)
        except BaseException:
            await self._discard(chain.id, tenant)
            raise
        return turn, imported

    async def _start_continued(self, req: ResponsesRequest, tenant: str, items: list[InputItem],
                               tools: list[dict[str, Any]] | None, sampling: dict[str, Any]) -> Any:
        """With ``previous_response_id``: a turn of its chain, or of a fork rewound to its turn (an older
        response; the fork is deleted again if the turn does not start)."""
        assert req.previous_response_id is not None
        previous = self.records.get(req.previous_response_id)
        if previous is None or previous.tenant != tenant:
            raise bad_field("previous_response_id", f"no response with the id {req.previous_response_id!r}",
                            code="previous_response_not_found")
        state = await self.chains.state(previous.chain_id, tenant)
        if req.instructions is not None and req.instructions != state.row.system_prompt:
            raise bad_field("instructions", "differs from the conversation's (the chain's system prompt is "
                                            "fixed): leave it out or repeat it")
        if tools is not None and tools != state.row.tools:
            raise bad_field("tools", "differ from the conversation's (the chain renders its tools once): "
                                     "leave them out or repeat them")
        messages = self._messages(items, 0, previous)
        chain_id, forked = previous.chain_id, False
        if state.num_turns != previous.turn + 1:  # an older response: branch there
            fork = await self.chains.fork(chain_id, ForkRequest(metadata=METADATA), tenant=tenant)
            chain_id, forked = fork.id, True
        try:
            if forked:
                await self.chains.rewind(chain_id, RewindRequest(num_turns=previous.turn + 1), tenant=tenant)
            data = self._turn(req, messages, sampling)
            with template_kwargs(enable_thinking=_thinking(req)):
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
            chain_tools = None if tools is None else msgspec.to_builtins(_convert(tools, list[Tool], "tools"))
            row: dict[str, Any] = {}
            if first:
                parts = ([req.instructions] if req.instructions is not None else []) + plan.system_texts
                system = "\n".join(parts) if parts else self.config.default_system_prompt
                no_nul(req.instructions, "instructions")
                _convert({"system_prompt": system}, ChainCreate, "instructions")
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
            data = self._turn(req, plan.messages[plan.offset:], sampling)
            await self.conversations.record(plan, first, req.instructions, **row)
            imported: list[TurnResult] = []
            if plan.offset:
                imported, _ = await implicit_chains_for(self.chains).import_history(
                    tenant, state.id, plan.messages, 0, plan.names)
            with template_kwargs(enable_thinking=_thinking(req)):
                turn = await self.chains.start_turn(state.id, data, tenant=tenant)
        finally:
            self.conversations.release(plan)
        return turn, imported

    async def _discard(self, chain_id: str, tenant: str) -> None:
        try:
            await self.chains.delete(chain_id, tenant=tenant)
        except Exception:  # the request's own error is what the client gets
            log.exception("could not delete chain %s", chain_id)

    def _messages(self, items: list[InputItem], start: int, previous: Record | None) -> list[dict[str, Any]]:
        echoed = set()
        if previous is not None and previous.response is not None:
            echoed = {o.call_id for o in previous.response.output if isinstance(o, OutputFunctionCall)}
            echoed |= {o.id for o in previous.response.output if isinstance(o, OutputMessage)}
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
                messages.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id})
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
                messages.append({"role": "user", "content": _text(item.content)})
        if not messages:
            raise bad_field("input", "must hold a user message or a function_call_output")
        return messages

    async def start(self, req: ResponsesRequest, tenant: str) -> Pending:
        self._refuse(req)
        items = self._items(req)
        tools = self._tools(req)
        given_tools = tools
        conversation = _conversation_id(req)
        if conversation is not None and req.previous_response_id is not None:
            raise bad_field("previous_response_id", "cannot be given with `conversation`: the conversation's "
                                                    "next turn follows its last (give one of them)")
        if req.previous_response_id is not None and tools is None:
            previous = self.records.get(req.previous_response_id)
            if previous is not None and previous.tenant == tenant:
                tools = (await self.chains.state(previous.chain_id, tenant)).row.tools
        elif conversation is not None and tools is None:
            tools = (await self.conversations.state(conversation, tenant)).row.tools
        sampling, parse_calls = self._sampling(req, tools or [])
        imported: list[TurnResult] = []
        item_ids: list[str | None] = []
        item_key = None
        if req.previous_response_id is not None:
            turn = await self._start_continued(req, tenant, items, tools, sampling)
        elif conversation is not None:
            plan = await self.conversations.plan(conversation, tenant, items, parse_calls)
            turn, imported = await self._start_conversation(req, tenant, plan, given_tools, sampling)
            item_ids, item_key = plan.input_ids, plan.key
        else:
            conv = self._conversation(req, items)
            tools = msgspec.to_builtins(_convert(tools or [], list[Tool], "tools"))
            start = self._start_implicit if self.config.implicit_chains else self._start_new
            turn, imported = await start(req, tenant, conv, tools, sampling)
        state = turn.state
        stored = req.store is not False
        input_items = [{**msgspec.to_builtins(it), "id": (item_ids[i] if i < len(item_ids) else None)
                        or getattr(it, "id", None) or _new_id("item")}
                       for i, it in enumerate(items)] if stored else []  # never read back when not stored
        record = Record(tenant=tenant, chain_id=state.id, turn=state.num_turns, stored=stored,
                        input_items=input_items)
        response = ResponseObject(
            id=_new_id("resp"), created_at=int(time.time()), model=self.model_name, status="in_progress", output=[],
            instructions=state.row.system_prompt, tools=[_response_tool(t) for t in state.row.tools],
            tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=sampling["temperature"],
            top_p=sampling["top_p"], max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, metadata=req.metadata or {},
            text=msgspec.to_builtins(req.text) if req.text is not None and req.text.format is not None
            else {"format": {"type": "text"}}, store=stored,
            conversation=ResponseConversation(id=conversation) if conversation is not None else None)
        return Pending(response=response, record=record, turn=turn, parse_calls=parse_calls,
                       thinking=self.chains.renderer.renderer.thinking(turn.prompt), imported=imported,
                       item_key=item_key)

    # --- the response -------------------------------------------------------------------------------------
    def _finish(self, pending: Pending, result: TurnResult, output: list[Any]) -> ResponseObject:
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
                output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens(pending, result)),
                total_tokens=u.prompt_tokens + u.completion_tokens))
        pending.record.turn = result.turn
        pending.record.response = response
        self.records[response.id] = pending.record
        return response

    def _reasoning_tokens(self, pending: Pending, result: TurnResult) -> int:
        """The generated tokens of the think block: up to its closing tag, or all of them when it never closed."""
        think = self.chains.renderer.renderer.think
        if pending.thinking is None or think is None:
            return 0
        parser = ReasoningParser(pending.thinking)
        parser.feed(result.message.content)
        parser.finish()
        state = self.chains.states.get(result.chain_id)
        n = result.usage.completion_tokens
        if not parser.found or state is None or not n:
            return 0
        generated = state.token_ids[-n:]
        return generated.index(think.close_id) + 1 if think.close_id in generated else n

    def _output(self, result: TurnResult, pending: Pending, message_id: str | None = None,
                reasoning_id: str | None = None) -> list[Any]:
        thought, text = "", result.message.content
        if pending.thinking is not None:
            thought, text = split_reasoning(text, pending.thinking)
        calls = []
        if pending.parse_calls:
            chain_calls = result.message.tool_calls  # the chain's ids: its tool results are matched to them
            calls = chain_calls[len(chain_calls) - min(len(calls_in(text)), len(chain_calls)):]
            text = without_calls(text)
        output: list[Any] = []
        key = pending.item_key
        if key is not None:  # a conversation's turn: the ids its items are listed with
            reasoning_id, message_id = reasoning_id or output_ids(key)[0], message_id or output_ids(key)[1]
        if thought:
            output.append(OutputReasoning(id=reasoning_id or _new_id("rs"),
                                          content=[ReasoningTextPart(text=thought)]))
        if text:
            output.append(OutputMessage(id=message_id or _new_id("msg"), content=[OutputTextPart(text=text)]))
        output += [OutputFunctionCall(id=call_item_id(key, j) if key is not None else _new_id("fc"), call_id=c.id,
                                      name=c.function.name, arguments=c.function.arguments)
                   for j, c in enumerate(calls)]
        return output

    async def create(self, req: ResponsesRequest, tenant: str) -> ResponseObject:
        pending = await self.start(req, tenant)
        try:
            result = await pending.turn.result()
        finally:
            await pending.turn.close()
        return self._finish(pending, result, self._output(result, pending))

    def _event(self, pending: Pending, kind: str, **body: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": pending.seq, **msgspec.to_builtins(body)}
        pending.seq += 1
        return ServerSentEventMessage(event=kind, data=json.dumps(data, ensure_ascii=False))

    async def events(self, pending: Pending) -> AsyncGenerator[ServerSentEventMessage, None]:
        ev = self._event
        yield ev(pending, "response.created", response=pending.response)
        yield ev(pending, "response.in_progress", response=pending.response)
        parser = ToolCallStream() if pending.parse_calls else None
        thinking = reasoning_parser(pending.thinking)
        rs_id, msg_id = output_ids(pending.item_key) if pending.item_key is not None else (_new_id("rs"),
                                                                                            _new_id("msg"))
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
            out = self._reasoning_delta(pending, rs_id, thought, reasoning)
            thought += reasoning
            if parser is not None:
                rest = parser.feed(rest)[0] if rest else ""
                if final:
                    rest += parser.finish()[0]
            if rest:
                out += close_reasoning()
                out += self._text_delta(pending, msg_id, 1 if thought else 0, text, rest)
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
            output = self._output(result, pending, msg_id, rs_id)
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
            response = self._finish(pending, result, output)
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield ev(pending, kind, response=response)
        except Exception as exc:  # the status line is sent: the error goes into the stream
            log.info("response stream %s failed: %r", pending.response.id, exc)
            error = msgspec.to_builtins(openai_error_body(exc)).get("error", {})
            yield ev(pending, "error", code=error.get("code"), message=error.get("message", str(exc)),
                     param=error.get("param"))

    def _reasoning_delta(self, pending: Pending, rs_id: str, before: str,
                         delta: str) -> list[ServerSentEventMessage]:
        if not delta:
            return []
        events = []
        if not before:
            item = OutputReasoning(id=rs_id, content=[], status="in_progress")
            events.append(self._event(pending, "response.output_item.added", output_index=0, item=item))
            events.append(self._event(pending, "response.content_part.added", item_id=rs_id, output_index=0,
                                      content_index=0, part=ReasoningTextPart(text="")))
        events.append(self._event(pending, "response.reasoning_text.delta", item_id=rs_id, output_index=0,
                                  content_index=0, delta=delta))
        return events

    def _text_delta(self, pending: Pending, msg_id: str, index: int, before: str,
                    delta: str) -> list[ServerSentEventMessage]:
        if not delta:
            return []
        events = []
        if not before:
            item = OutputMessage(id=msg_id, content=[], status="in_progress")
            events.append(self._event(pending, "response.output_item.added", output_index=index, item=item))
            events.append(self._event(pending, "response.content_part.added", item_id=msg_id, output_index=index,
                                      content_index=0, part=OutputTextPart(text="")))
        events.append(self._event(pending, "response.output_text.delta", item_id=msg_id, output_index=index,
                                  content_index=0, delta=delta, logprobs=[]))
        return events

    # --- stored responses ------------------------------------------------------------------------------------
    def _stored(self, response_id: str, tenant: str) -> Record:
        record = self.records.get(response_id)
        if record is None or record.tenant != tenant or not record.stored or record.response is None:
            raise ResponseNotFound(response_id)
        return record

    def get(self, response_id: str, tenant: str) -> ResponseObject:
        return self._stored(response_id, tenant).response  # type: ignore[return-value]

    def delete(self, response_id: str, tenant: str) -> None:
        """The response is forgotten (its chain and turn stay: they belong to the chain API)."""
        self._stored(response_id, tenant)
        del self.records[response_id]

    def input_items(self, response_id: str, tenant: str, order: str = "desc", limit: int = 20,
                    after: str | None = None) -> InputItemList:
        items = list(self._stored(response_id, tenant).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _conversation_id(req: ResponsesRequest) -> str | None:
    c = req.conversation
    return c if c is None or isinstance(c, str) else c.id


def _effort(req: ResponsesRequest) -> str | None:
    effort = (req.reasoning or {}).get("effort")
    return effort if effort is None or isinstance(effort, str) else str(effort)


def _thinking(req: ResponsesRequest) -> bool | None:
    """The chat template's ``enable_thinking`` (None: the template's default)."""
    effort = _effort(req)
    return None if effort is None else effort != "none"


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    f = tool["function"]
    return {"type": "function", "name": f["name"], "description": f.get("description"),
            "parameters": f.get("parameters"), "strict": False}


def responses_service(state: State) -> ResponseService:
    service = getattr(state, "responses", None)
    if service is None:
        service = ResponseService(state.chains, state.model_name, state.config, conversations_service(state))
        state.responses = service
    return service
