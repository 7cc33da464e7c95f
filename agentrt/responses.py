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

The map response -> (chain, turn) is a database row per response (agentrt.models.ResponseRow: its tenant,
chain, turn, ``store`` flag, the response object and, when stored, its input items), for every response, of an
implicit chain too: a later ``previous_response_id`` continues it. The row is written in the transaction that
commits the chain turn (``PendingTurn.extra_rows``), so a failed or aborted turn leaves none, and it is deleted
with its chain (ON DELETE CASCADE: deleting the chain, a conversation, or an implicit chain evicted). So
responses survive a restart: GET, input_items, DELETE and ``previous_response_id`` read the database (the next
turn recomputes the KV the restart dropped). A rewind of the chain (the chain API) leaves its responses.
``ResponseService.records`` caches the latest responses of this process (a bounded LRU, without input items);
an entry is used only while its chain's state is loaded here (ChainService.states, which deleting the chain
drops), else the row is read again. ``store: false``: the response is not retrievable (GET / DELETE /
input_items answer 404; its input items are not kept) but it can still be continued with
``previous_response_id``, and its chain keeps its KV. Another tenant's response id is a 404.

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
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.response import ServerSentEventMessage
from sqlalchemy import delete

from agentrt.anthropic_messages import ChainMoved
from agentrt.chains import no_nul
from agentrt.chat import Message, calls_in, template_kwargs, without_calls
from agentrt.completions import REASONING_EFFORTS
from agentrt.conversations import ConversationService, TurnPlan, call_item_id, conversations_service, output_ids
from agentrt.errors import ModelNotFound, bad_field, openai_error_body
from agentrt.implicit_chains import implicit_chains_for
from agentrt.models import ResponseRow
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
OUTPUT_TYPES = {"message": OutputMessage, "function_call": OutputFunctionCall, "reasoning": OutputReasoning}
CACHED_RECORDS = 1024  # ResponseService.records: the latest responses read or made by this process


class ResponseNotFound(NotFoundException):
    def __init__(self, response_id: str):
        super().__init__(detail=f"no response with the id {response_id!r}")


@dataclass(slots=True)
class Record:
    """A response (its row less the input items): the chain turn it is."""

    tenant: str
    chain_id: str
    turn: int  # the chain turn's index (the chain has turn + 1 turns right after it)
    stored: bool
    response: ResponseObject | None = None  # None until the turn is committed


@dataclass(slots=True)
class Pending:
    response: ResponseObject
    record: Record
    turn: Any  # agentrt.turns.PendingTurn
    parse_calls: bool
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as input_items lists them; [] unless stored
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    imported: list[TurnResult] = field(default_factory=list)  # history turns this request appended first
    item_key: str | None = None  # a conversation's turn: its output item ids (agentrt.conversations.output_ids)
    message_id: str = ""  # the output's message / reasoning item ids
    reasoning_id: str = ""
    done: ResponseObject | None = None  # the finished response, made when the turn commits
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
        self.records: OrderedDict[str, Record] = OrderedDict()  # a cache of the rows (module docstring)
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
        forced = req.forced_token_ids or []
        vocab = self.chains.worker.engine.model_config.vocab_size
        if len(forced) > self._max_tokens(req):
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

    def _max_tokens(self, req: ResponsesRequest) -> int:
        """``max_output_tokens`` within the server's per-turn limit (a larger one is lowered to it, and by the
        engine to what the context holds: the response is then incomplete, ``max_output_tokens``)."""
        return min(req.max_output_tokens or self.config.max_tokens_per_turn, self.config.max_tokens_per_turn)

    def _sampling(self, req: ResponsesRequest, tools: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        greedy = req.top_p == 0
        sampling: dict[str, Any] = {
            "temperature": 0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None or greedy else req.top_p,
            "max_tokens": self._max_tokens(req), "fit_max_tokens": True}
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
        return _convert({"messages": messages, "sampling": sampling, "stream": bool(req.stream),
                         "hints": None if req.session_hints is None else msgspec.to_builtins(req.session_hints)},
                        TurnCreate, "input")

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
        previous = None
        if req.previous_response_id is not None:
            previous = await self._record(req.previous_response_id, tenant)
        if previous is not None and tools is None:
            tools = (await self.chains.state(previous.chain_id, tenant)).row.tools
        elif conversation is not None and tools is None:
            tools = (await self.conversations.state(conversation, tenant)).row.tools
        sampling, parse_calls = self._sampling(req, tools or [])
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
            conv = self._conversation(req, items)
            tools = msgspec.to_builtins(_convert(tools or [], list[Tool], "tools"))
            start = self._start_implicit if self.config.implicit_chains else self._start_new
            turn, imported = await start(req, tenant, conv, tools, sampling)
        state = turn.state
        stored = req.store is not False
        input_items = [{**msgspec.to_builtins(it), "id": (item_ids[i] if i < len(item_ids) else None)
                        or getattr(it, "id", None) or _new_id("item")}
                       for i, it in enumerate(items)] if stored else []  # never read back when not stored
        record = Record(tenant=tenant, chain_id=state.id, turn=state.num_turns, stored=stored)
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
        reasoning_id, message_id = output_ids(item_key) if item_key is not None else (_new_id("rs"), _new_id("msg"))
        pending = Pending(response=response, record=record, turn=turn, parse_calls=parse_calls,
                          input_items=input_items, thinking=self.chains.renderer.renderer.thinking(turn.prompt),
                          imported=imported, item_key=item_key, message_id=message_id, reasoning_id=reasoning_id)
        turn.extra_rows = lambda result, generated: self._rows(pending, result, generated)
        return pending

    # --- the response -------------------------------------------------------------------------------------
    def _rows(self, pending: Pending, result: TurnResult, generated: list[int]) -> list[ResponseRow]:
        """The response's row, written in the transaction that commits its turn (``PendingTurn.extra_rows``);
        the finished response becomes ``pending.done``."""
        response = self._response(pending, result, self._output(result, pending), generated)
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
        self._remember(response.id, pending.record)
        return response

    def _response(self, pending: Pending, result: TurnResult, output: list[Any],
                  generated: list[int]) -> ResponseObject:
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
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=self._reasoning_tokens(pending, result, generated)),
                total_tokens=u.prompt_tokens + u.completion_tokens))
        return response

    def _reasoning_tokens(self, pending: Pending, result: TurnResult, generated: list[int]) -> int:
        """The generated tokens of the think block: up to its closing tag, or all of them when it never closed."""
        think = self.chains.renderer.renderer.think
        if pending.thinking is None or think is None:
            return 0
        parser = ReasoningParser(pending.thinking)
        parser.feed(result.message.content)
        parser.finish()
        n = len(generated)
        if not parser.found or not n:
            return 0
        return generated.index(think.close_id) + 1 if think.close_id in generated else n

    def _output(self, result: TurnResult, pending: Pending) -> list[Any]:
        thought, text = "", result.message.content
        if pending.thinking is not None:
            thought, text = split_reasoning(text, pending.thinking)
        calls = []
        if pending.parse_calls:
            chain_calls = result.message.tool_calls  # the chain's ids: its tool results are matched to them
            calls = chain_calls[len(chain_calls) - min(len(calls_in(text)), len(chain_calls)):]
            text = without_calls(text)
        output: list[Any] = []
        key = pending.item_key  # a conversation's turn: its message / reasoning ids are the conversation's
        if thought:
            output.append(OutputReasoning(id=pending.reasoning_id, content=[ReasoningTextPart(text=thought)]))
        if text:
            output.append(OutputMessage(id=pending.message_id, content=[OutputTextPart(text=text)]))
        output += [OutputFunctionCall(id=call_item_id(key, j) if key is not None else _new_id("fc"), call_id=c.id,
                                      name=c.function.name, arguments=c.function.arguments)
                   for j, c in enumerate(calls)]
        return output

    async def create(self, req: ResponsesRequest, tenant: str) -> ResponseObject:
        pending = await self.start(req, tenant)
        try:
            await pending.turn.result()
        finally:
            await pending.turn.close()
        return self._finish(pending)

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
            response = self._finish(pending)
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
    def _remember(self, response_id: str, record: Record) -> None:
        self.records[response_id] = record
        self.records.move_to_end(response_id)
        while len(self.records) > CACHED_RECORDS:
            self.records.popitem(last=False)

    async def _row(self, response_id: str) -> ResponseRow | None:
        if "\x00" in response_id:  # no response has one (and PostgreSQL cannot even compare it)
            return None
        async with self.chains.db.sessions() as s:
            return await s.get(ResponseRow, response_id)

    async def _record(self, response_id: str, tenant: str) -> Record | None:
        """The response's record, None when there is none for ``tenant``: from the cache while its chain's state
        is loaded (deleting the chain drops both), else from its row."""
        record = self.records.get(response_id)
        if record is not None and record.chain_id in self.chains.states:
            self.records.move_to_end(response_id)
        else:
            row = await self._row(response_id)
            if row is None:
                self.records.pop(response_id, None)
                return None
            record = Record(tenant=row.tenant, chain_id=row.chain_id, turn=row.turn, stored=row.stored,
                            response=_response_object(row.response))
            self._remember(response_id, record)
        return record if record.tenant == tenant else None

    async def _stored(self, response_id: str, tenant: str) -> Record:
        record = await self._record(response_id, tenant)
        if record is None or not record.stored or record.response is None:
            raise ResponseNotFound(response_id)
        return record

    async def get(self, response_id: str, tenant: str) -> ResponseObject:
        return (await self._stored(response_id, tenant)).response  # type: ignore[return-value]

    async def delete(self, response_id: str, tenant: str) -> None:
        """The response is forgotten (its chain and turn stay: they belong to the chain API)."""
        await self._stored(response_id, tenant)
        async with self.chains.db.sessions.begin() as s:
            deleted = (await s.execute(delete(ResponseRow).where(ResponseRow.id == response_id))).rowcount
        self.records.pop(response_id, None)
        if not deleted:  # deleted meanwhile (with its chain, or by a concurrent DELETE)
            raise ResponseNotFound(response_id)

    async def input_items(self, response_id: str, tenant: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> InputItemList:
        row = await self._row(response_id)
        if row is None or row.tenant != tenant or not row.stored:
            raise ResponseNotFound(response_id)
        items = list(row.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _response_object(stored: dict[str, Any]) -> ResponseObject:
    """A response object as its row holds it (``msgspec.to_builtins``), its output items typed again."""
    response = msgspec.convert(stored, ResponseObject)
    return msgspec.structs.replace(response, output=[msgspec.convert(o, OUTPUT_TYPES[o["type"]])
                                                     for o in response.output])


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
