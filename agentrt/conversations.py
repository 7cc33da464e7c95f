"""OpenAI's Conversations API over chains (docs/responses.md, "Conversations").

A conversation is a chain of the tenant: ``conv_<hex>`` is the chain ``chain_<hex>`` (the same 32 hex digits), so
the map conversation -> chain needs no table and survives a restart. What the chain rows do not hold lives in the
chain's metadata, under ``agentrt_conversation`` (which also marks the chain as a conversation: another chain's
``conv_`` id is a 404):

- ``metadata``: the conversation's own metadata (OpenAI's: at most 16 string pairs);
- ``system``: the ``system`` / ``developer`` items given when the conversation was created (they open it; the
  chain's system prompt is their text, joined by a newline);
- ``pending``: items added (at creation or by ``POST .../items``) that no turn has taken yet: the next response of
  the conversation takes them, before its own input;
- ``turns``: per chain turn made by this module, the ids of its items (``in``: one per turn message; the output's
  from ``key``, or ``msg`` / ``fc`` for a turn imported from added assistant items), ``calls`` (whether its text
  was read for tool calls: ``tool_choice`` not ``"none"``), ``think`` (False for an imported turn) and ``h``, a
  digest of the turn's messages. An entry counts only for a turn the chain holds whose messages match ``h``;
  a turn without one (made through the chain API, or its entry stale after a rewind) gets ids derived from its
  position (``msg_<hex>_<turn>_<k>``).
- ``instructions``: the ``instructions`` of the conversation's first response (later ones must repeat them or
  leave them out).

The items are read from the chain's turns on every request: per turn its messages (a user message a ``message``
item, a tool message a ``function_call_output``) and then its output, split as the response returned it (a
``reasoning`` item, a ``message``, one ``function_call`` per call: agentrt.responses). A pending item is
consumed once a turn the chain holds lists its id. Nothing is kept in this process but a lock and the set of
conversations whose turn is being started.

Deleting an item: a pending item is removed; an item of a turn the chain holds is refused (400): its tokens are
in the chain's KV, which cannot lose a piece in the middle, and taking out the whole turn (a rewind) would delete
more than the item asked for. ``POST /v1/chains/{chain_id}/rewind`` drops whole turns explicitly.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from msgspec import Meta, Struct

from agentrt.chain_state import ChainState
from agentrt.chains import no_nul
from agentrt.chat import Message, calls_in, without_calls
from agentrt.errors import ChainBusy, ChainNotFound, bad_field
from agentrt.models import TurnRow
from agentrt.reasoning import split_reasoning
from agentrt.responses_types import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem,
                                     OutputFunctionCall, OutputMessage, OutputReasoning, OutputText, OutputTextPart,
                                     ReasoningItem, ReasoningTextPart)
from sdk.schema import ChainCreate, TurnMessage

KEY = "agentrt_conversation"  # the chain metadata that makes a chain a conversation
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MAX_ITEMS = 20  # per request, as OpenAI's
_HEX = re.compile(r"[0-9a-f]{32}")


class _In(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=16)]


class ConversationCreate(_In):
    items: Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS)] | None = None
    metadata: Metadata | None = None
    safety_identifier: str | None = None  # accepted, no effect


class ConversationUpdate(_In):
    metadata: Metadata | None  # required (OpenAI's); null clears it


class ItemsCreate(_In):
    items: Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_ITEMS)]


class ConversationObject(Struct, kw_only=True):
    id: str
    created_at: int
    metadata: dict[str, str]
    object: str = "conversation"


class ConversationDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: str = "conversation.deleted"


class ConversationItemList(Struct, kw_only=True):
    """A page of a conversation's items (OpenAI's ``ConversationItemList``; ``first_id`` / ``last_id`` null on an
    empty page)."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class ConversationNotFound(NotFoundException):
    def __init__(self, conversation_id: str):
        super().__init__(detail=f"no conversation with the id {conversation_id!r}")


class ItemNotFound(NotFoundException):
    def __init__(self, item_id: str, conversation_id: str):
        super().__init__(detail=f"no item with the id {item_id!r} in the conversation {conversation_id!r}")


# --- ids ----------------------------------------------------------------------------------------------------
def chain_id_of(conversation_id: str) -> str | None:
    hex_ = conversation_id.removeprefix("conv_")
    return f"chain_{hex_}" if conversation_id.startswith("conv_") and _HEX.fullmatch(hex_) else None


def conversation_id_of(chain_id: str) -> str:
    return f"conv_{chain_id.removeprefix('chain_')}"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_ids(key: str) -> tuple[str, str]:
    """The ids of a response turn's reasoning and message items (its calls': ``call_item_id``)."""
    return f"rs_{key}", f"msg_{key}"


def call_item_id(key: str, j: int) -> str:
    return f"fc_{key}_{j}"


def digest(messages: Sequence[Message]) -> str:
    """What identifies a turn's messages (user and tool messages: role, content, call id)."""
    rows = [[m["role"], m["content"], m.get("tool_call_id")] for m in messages]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()[:24]


# --- items --------------------------------------------------------------------------------------------------
def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _message(item_id: str, role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return msgspec.to_builtins(OutputMessage(id=item_id, content=[OutputTextPart(text=text)]))
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": "input_text", "text": text}]}


def _call(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return msgspec.to_builtins(OutputFunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments))


def _call_output(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call_output", "call_id": call_id, "output": output,
            "status": "completed"}


def parse_item(raw: dict[str, Any], key: str) -> InputItem:
    """An input item as the Responses route reads one (400 naming ``key`` or its field)."""
    kind = raw.get("type", "message")
    if kind not in ITEM_TYPES:
        raise bad_field(f"{key}.type", f"{kind!r} is not an item this server takes (one of {', '.join(ITEM_TYPES)})")
    try:
        return msgspec.convert({"type": "message", **raw}, InputItem)
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


def stored_item(item: InputItem, key: str, item_id: str) -> dict[str, Any] | None:
    """``item`` as the conversation lists it, with ``item_id`` (None: a ``reasoning`` item, which is skipped: the
    chain holds the reasoning as generated)."""
    if isinstance(item, ReasoningItem):
        return None
    if isinstance(item, FunctionCallItem):
        return _call(item_id, item.call_id, item.name, item.arguments)
    if isinstance(item, FunctionCallOutputItem):
        message = {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
        _check_message(message, key)
        return _call_output(item_id, item.call_id, message["content"])
    if item.role != "assistant" and not isinstance(item.content, str) \
            and any(isinstance(p, OutputText) for p in item.content):
        raise bad_field(f"{key}.content", f"a {item.role} message takes input_text parts")
    if item.role == "user":
        _check_message({"role": "user", "content": _text(item.content)}, key)
    return _message(item_id, item.role, _text(item.content))


def _check_message(message: Message, key: str) -> None:
    try:
        msgspec.convert(message, TurnMessage)  # the turn's limits, named here
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


def _text_of(item: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in item.get("content") or [])


@dataclass(slots=True)
class History:
    """Items (as stored) as the chain routes' messages: consecutive assistant ``message`` / ``function_call``
    items are one assistant message; per message the ids of its items and the field to name in an error."""

    messages: list[Message] = field(default_factory=list)
    ids: list[list[str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    calls: list[list[tuple[str, str]]] = field(default_factory=list)  # an assistant message's (item id, call id)


def history(items: Sequence[tuple[dict[str, Any], str]]) -> History:
    out = History()
    called: dict[str, str] = {}  # call id -> name, of the function_call items among ``items``
    for item, name in items:
        assistant = item["type"] == "function_call" or (item["type"] == "message" and item["role"] == "assistant")
        if assistant:
            if not out.messages or out.messages[-1]["role"] != "assistant":
                out.messages.append({"role": "assistant", "content": ""})
                out.ids.append([])
                out.names.append(name)
                out.calls.append([])
            message = out.messages[-1]
            if item["type"] == "function_call":
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
                called[item["call_id"]] = item["name"]
                out.calls[-1].append((item["id"], item["call_id"]))
            else:
                message["content"] += _text_of(item)
            out.ids[-1].append(item["id"])
            continue
        if item["type"] == "function_call_output":
            message = {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
            if item["call_id"] in called:
                message["name"] = called[item["call_id"]]
        elif item["role"] in ("system", "developer"):
            raise bad_field(f"{name}.role", "system and developer messages may only open a conversation (in "
                                            "`items` of POST /v1/conversations): the chain's system prompt is fixed")
        else:
            message = {"role": "user", "content": _text_of(item)}
        out.messages.append(message)
        out.ids.append([item["id"]])
        out.names.append(name)
        out.calls.append([])
    return out


# --- the service ----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TurnPlan:
    """The next turn(s) of a conversation, checked and not yet started: ``messages[:offset]`` are imported
    (added assistant items, one turn per assistant message: agentrt.implicit_chains.import_history), the rest is
    the response's turn."""

    conversation_id: str
    state: ChainState
    messages: list[Message]
    names: list[str]
    offset: int
    entries: dict[str, dict[str, Any]]  # turn index -> its ``turns`` entry
    key: str  # the response turn's output ids (output_ids, call_item_id)
    input_ids: list[str | None]  # the conversation's id of each request item (None: skipped)
    system_texts: list[str]
    instructions: str | None  # the first response's, once there was one


class ConversationService:
    def __init__(self, chains: Any):
        self.chains = chains
        self._lock = asyncio.Lock()  # read-modify-write of a conversation's metadata
        self.starting: set[str] = set()  # chains whose conversation turn is being planned and started

    # --- lookups ------------------------------------------------------------------------------------------
    async def state(self, conversation_id: str, tenant: str) -> ChainState:
        chain_id = chain_id_of(conversation_id)
        if chain_id is None:
            raise ConversationNotFound(conversation_id)
        try:
            state = await self.chains.state(chain_id, tenant)
        except ChainNotFound:
            raise ConversationNotFound(conversation_id) from None
        if not isinstance(state.row.meta, dict) or not isinstance(state.row.meta.get(KEY), dict):
            raise ConversationNotFound(conversation_id)
        return state

    def _object(self, state: ChainState) -> ConversationObject:
        return ConversationObject(id=conversation_id_of(state.id), created_at=int(state.row.created_at),
                                  metadata=dict(state.row.meta[KEY].get("metadata") or {}))

    async def _write(self, state: ChainState, conv: dict[str, Any], **row: Any) -> None:
        """The conversation's metadata ``conv`` (and chain row columns ``row``) written to the database, then to
        the chain's state (call holding ``self._lock``, or for a chain no other request can touch yet)."""
        await self.chains.write_row(state, meta={**state.row.meta, KEY: conv}, **row)

    def _busy(self, chain_id: str) -> bool:
        return chain_id in self.chains.busy or chain_id in self.starting

    # --- conversations ------------------------------------------------------------------------------------
    async def create(self, data: ConversationCreate, tenant: str) -> ConversationObject:
        system: list[dict[str, Any]] = []
        pending: list[dict[str, Any]] = []
        for i, raw in enumerate(data.items or []):
            key = f"items[{i}]"
            item = parse_item(raw, key)
            if isinstance(item, ReasoningItem):
                raise bad_field(f"{key}.type", "reasoning items cannot be added: the chain holds the reasoning "
                                               "as generated")
            if isinstance(item, MessageItem) and item.role in ("system", "developer"):
                if pending:
                    raise bad_field(f"{key}.role", "system and developer messages may only open the conversation "
                                                   "(they become its chain's system prompt)")
                no_nul(_text(item.content), f"{key}.content")
            stored = stored_item(item, key, _new_id(_prefix(item)))
            assert stored is not None
            (system if stored.get("role") in ("system", "developer") else pending).append(stored)
        _check_pending([(p, f"items[{len(system) + i}]") for i, p in enumerate(pending)])
        conv = {"metadata": data.metadata or {}, "system": system, "pending": pending, "turns": {}}
        system_prompt = "\n".join(_text_of(s) for s in system) if system else None
        try:
            request = msgspec.convert({"system_prompt": system_prompt, "metadata": {KEY: conv}}, ChainCreate)
        except msgspec.ValidationError as exc:
            raise bad_field("items", str(exc)) from None
        chain = await self.chains.create(request, tenant=tenant)
        return ConversationObject(id=conversation_id_of(chain.id), created_at=int(chain.created_at),
                                  metadata=dict(conv["metadata"]))

    async def get(self, conversation_id: str, tenant: str) -> ConversationObject:
        return self._object(await self.state(conversation_id, tenant))

    async def update(self, conversation_id: str, data: ConversationUpdate, tenant: str) -> ConversationObject:
        async with self._lock:
            state = await self.state(conversation_id, tenant)
            conv = copy.deepcopy(state.row.meta[KEY])
            conv["metadata"] = data.metadata or {}
            await self._write(state, conv)
        return self._object(state)

    async def delete(self, conversation_id: str, tenant: str) -> None:
        """The conversation's chain is deleted (409 while it has a turn in flight)."""
        state = await self.state(conversation_id, tenant)
        if chain_id_of(conversation_id) in self.starting:
            raise ChainBusy(state.id)
        await self.chains.delete(state.id, tenant=tenant)

    # --- items --------------------------------------------------------------------------------------------
    async def _items(self, state: ChainState) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
        """(the items of the system prompt and of the chain's turns, the pending items, the ids of the turns'
        items), read from the chain's rows."""
        chain, turns, _ = await self.chains.rows(state.id)
        conv = (chain.meta or {}).get(KEY) or {}
        items = list(conv.get("system") or [])
        taken: set[str] = set()
        for row in turns:
            turn_items = self._turn_items(state.id, row, _entry(conv, row))
            items += turn_items
            taken.update(i["id"] for i in turn_items)
        pending = [p for p in conv.get("pending") or [] if p["id"] not in taken]
        return items, pending, taken

    def _turn_items(self, chain_id: str, row: TurnRow, entry: dict[str, Any] | None) -> list[dict[str, Any]]:
        where = f"{chain_id.removeprefix('chain_')}_{row.index}"  # ids of a turn without an entry
        ids = entry["in"] if entry is not None else None
        items = []
        for k, m in enumerate(row.messages):
            if m["role"] == "tool":
                items.append(_call_output(ids[k] if ids else f"fco_{where}_{k}", m["tool_call_id"], m["content"]))
            else:
                items.append(_message(ids[k] if ids else f"msg_{where}_{k}", "user", m["content"]))
        key = (entry or {}).get("key") or where
        renderer = self.chains.renderer.renderer
        thinking = None
        if renderer.think is not None:
            thinking = entry["think"] if entry is not None and "think" in entry else \
                renderer.thinking(row.appended_token_ids)
        rs_id, msg_id = output_ids(key)
        calls = (entry or {}).get("fc") or []
        return items + turn_output(row.content, row.tool_calls, thinking,
                                   entry["calls"] if entry is not None else True,
                                   rs_id, (entry or {}).get("msg") or msg_id,
                                   lambda j: calls[j] if j < len(calls) else (call_item_id(key, j), None))

    async def list_items(self, conversation_id: str, tenant: str, limit: int = 20, order: str = "desc",
                         after: str | None = None) -> ConversationItemList:
        state = await self.state(conversation_id, tenant)
        items, pending, _ = await self._items(state)
        items += pending
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise bad_field("after", f"no item with the id {after!r} in the conversation")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return ConversationItemList(data=page, first_id=page[0]["id"] if page else None,
                                    last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)

    async def get_item(self, conversation_id: str, item_id: str, tenant: str) -> dict[str, Any]:
        state = await self.state(conversation_id, tenant)
        items, pending, _ = await self._items(state)
        for item in items + pending:
            if item["id"] == item_id:
                return item
        raise ItemNotFound(item_id, conversation_id)

    async def add_items(self, conversation_id: str, raw: list[dict[str, Any]], tenant: str) -> ConversationItemList:
        """The items are pending: the conversation's next response takes them (before its own input)."""
        added = []
        for i, r in enumerate(raw):
            key = f"items[{i}]"
            item = parse_item(r, key)
            if isinstance(item, ReasoningItem):
                raise bad_field(f"{key}.type", "reasoning items cannot be added: the chain holds the reasoning "
                                               "as generated")
            if isinstance(item, MessageItem) and item.role in ("system", "developer"):
                raise bad_field(f"{key}.role", "system and developer messages may only open a conversation (in "
                                               "`items` of POST /v1/conversations): its chain's system prompt is "
                                               "fixed")
            stored = stored_item(item, key, _new_id(_prefix(item)))
            assert stored is not None
            added.append(stored)
        async with self._lock:
            state = await self.state(conversation_id, tenant)
            _, pending, _ = await self._items(state)
            _check_pending([(p, "conversation") for p in pending] + [(a, f"items[{i}]") for i, a in enumerate(added)])
            conv = copy.deepcopy(state.row.meta[KEY])
            conv["pending"] = pending + added
            await self._write(state, conv)
        return ConversationItemList(data=added, first_id=added[0]["id"], last_id=added[-1]["id"])

    async def delete_item(self, conversation_id: str, item_id: str, tenant: str) -> ConversationObject:
        async with self._lock:
            state = await self.state(conversation_id, tenant)
            items, pending, _ = await self._items(state)
            if any(p["id"] == item_id for p in pending):
                conv = copy.deepcopy(state.row.meta[KEY])
                if self._busy(state.id) and any(item_id in e.get("in", []) for t, e in conv["turns"].items()
                                                if int(t) >= state.num_turns):
                    raise ChainBusy(state.id)  # the turn in flight takes it
                conv["pending"] = [p for p in pending if p["id"] != item_id]
                await self._write(state, conv)
                return self._object(state)
            if not any(i["id"] == item_id for i in items):
                raise ItemNotFound(item_id, conversation_id)
        if any(i["id"] == item_id for i in state.row.meta[KEY].get("system") or []):
            why = "it is part of the conversation's system prompt, which its chain rendered first"
        else:
            why = ("it belongs to a turn of the conversation's chain, whose KV holds it: items of past turns cannot "
                   f"be deleted one by one (POST /v1/chains/{state.id}/rewind drops whole turns)")
        raise bad_field("item_id", f"the item {item_id!r} cannot be deleted: {why}; only items that no response has "
                                   "taken yet can")

    # --- a response's turn --------------------------------------------------------------------------------
    async def plan(self, conversation_id: str, tenant: str, items: list[InputItem], parse_calls: bool) -> TurnPlan:
        """The next turn of the conversation: its pending items, then ``items`` (a request's input; ``input[i]``
        names them in errors). 404, 409 (a turn in flight) or 400 before anything changes; the conversation is
        marked as starting until ``release``."""
        state = await self.state(conversation_id, tenant)
        if self._busy(state.id):
            raise ChainBusy(state.id)
        self.starting.add(state.id)  # before any await: a concurrent request is a 409
        try:
            return await self._plan(conversation_id, state, items, parse_calls)
        except BaseException:
            self.starting.discard(state.id)
            raise

    async def _plan(self, conversation_id: str, state: ChainState, items: list[InputItem],
                    parse_calls: bool) -> TurnPlan:
        conv = state.row.meta[KEY]
        known: set[str] | None = None
        _, pending, _ = await self._items(state) if conv.get("pending") else ([], [], set())
        given: list[tuple[dict[str, Any], str]] = [(p, "conversation") for p in pending]
        input_ids: list[str | None] = []
        for i, item in enumerate(items):
            key = f"input[{i}]"
            if isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant"):
                if known is None:  # echoes of the conversation's items are skipped (it holds them)
                    turn_items, _, _ = await self._items(state)
                    known = {i["id"] for i in turn_items} | {i["call_id"] for i in turn_items
                                                            if i["type"] == "function_call"}
                if (item.call_id if isinstance(item, FunctionCallItem) else item.id) in known:
                    input_ids.append(None)
                    continue
            stored = stored_item(item, key, _new_id(_prefix(item)))
            input_ids.append(None if stored is None else stored["id"])
            if stored is not None:
                given.append((stored, key))
        hist = history(given)
        if not hist.messages or hist.messages[-1]["role"] == "assistant":
            raise bad_field("input", "must end with a user message or function_call_output items (after the "
                                     "conversation's pending items): the response follows them")
        _check_order(hist)
        entries: dict[str, dict[str, Any]] = {}
        turn, first = state.num_turns, 0
        for i, message in enumerate(hist.messages):
            if message["role"] != "assistant":
                continue
            text_ids = [x for x in hist.ids[i] if x not in {c[0] for c in hist.calls[i]}]
            entries[str(turn)] = {"h": digest(hist.messages[first:i]), "in": [x for ids in hist.ids[first:i]
                                                                              for x in ids],
                                  "calls": True, "think": False,
                                  "msg": text_ids[0] if text_ids and without_calls(message["content"]) else None,
                                  "fc": [list(c) for c in hist.calls[i]]}
            turn, first = turn + 1, i + 1
        key = uuid.uuid4().hex
        entries[str(turn)] = {"h": digest(hist.messages[first:]),
                              "in": [x for ids in hist.ids[first:] for x in ids], "key": key, "calls": parse_calls}
        return TurnPlan(conversation_id=conversation_id, state=state, messages=hist.messages, names=hist.names,
                        offset=first, entries=entries, key=key, input_ids=input_ids,
                        system_texts=[_text_of(s) for s in conv.get("system") or []],
                        instructions=conv.get("instructions"))

    async def record(self, plan: TurnPlan, first: bool, instructions: str | None, **row: Any) -> None:
        """The plan's turn entries (and on the conversation's first turn its instructions and the chain row's
        ``row`` columns) written before its turns start."""
        async with self._lock:
            conv = copy.deepcopy(plan.state.row.meta[KEY])
            conv.setdefault("turns", {}).update(plan.entries)
            if first:
                conv["instructions"] = instructions
            await self._write(plan.state, conv, **row)

    def release(self, plan: TurnPlan) -> None:
        self.starting.discard(plan.state.id)


def _prefix(item: InputItem) -> str:
    return "fc" if isinstance(item, FunctionCallItem) else "fco" if isinstance(item, FunctionCallOutputItem) \
        else "msg"


def _entry(conv: dict[str, Any], row: TurnRow) -> dict[str, Any] | None:
    entry = (conv.get("turns") or {}).get(str(row.index))
    if not isinstance(entry, dict) or entry.get("h") != digest(row.messages) \
            or len(entry.get("in") or []) != len(row.messages):
        return None
    return entry


def _check_order(hist: History) -> None:
    """An assistant message must follow a user message or tool results (the conversation's chain ends with the
    assistant's turn)."""
    for i, message in enumerate(hist.messages):
        if message["role"] == "assistant" and (i == 0 or hist.messages[i - 1]["role"] == "assistant"):
            raise bad_field(hist.names[i], "an assistant item must follow a user message or function_call_output "
                                           "(the conversation's last turn is the assistant's)")


def _check_pending(items: list[tuple[dict[str, Any], str]]) -> None:
    if items:
        _check_order(history(items))


def turn_output(content: str, tool_calls: list[dict[str, Any]], thinking: bool | None, parse_calls: bool,
                rs_id: str, msg_id: str, call_ids: Any) -> list[dict[str, Any]]:
    """A chain turn's output as the response returned it (agentrt.responses: a ``reasoning`` item, a ``message``
    without the tool-call markup, a ``function_call`` per call). ``call_ids(j)``: (item id, call id or None: the
    chain's) of the j-th call."""
    thought, text = "", content
    if thinking is not None:
        thought, text = split_reasoning(text, thinking)
    calls: list[dict[str, Any]] = []
    if parse_calls:
        calls = tool_calls[len(tool_calls) - min(len(calls_in(text)), len(tool_calls)):]
        text = without_calls(text)
    out: list[dict[str, Any]] = []
    if thought:
        out.append(msgspec.to_builtins(OutputReasoning(id=rs_id, content=[ReasoningTextPart(text=thought)])))
    if text:
        out.append(_message(msg_id, "assistant", text))
    for j, c in enumerate(calls):
        item_id, call_id = call_ids(j)
        out.append(_call(item_id, call_id or c["id"], c["function"]["name"], c["function"]["arguments"]))
    return out


def conversations_service(state: State) -> ConversationService:
    service = getattr(state, "conversations", None)
    if service is None:
        service = ConversationService(state.chains)
        state.conversations = service
    return service
