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
``reasoning`` item, a ``message``, one ``function_call`` per call: agentrt.responses; the items and their ids:
agentrt.conversations_items; the request bodies and returned objects: agentrt.conversations_types). A pending item is
consumed once a turn the chain holds lists its id. Nothing is kept in this process but a lock and the set of
conversations whose turn is being started.

Deleting an item: a pending item is removed; an item of a turn the chain holds is refused (400): its tokens are
in the chain's KV, which cannot lose a piece in the middle, and taking out the whole turn (a rewind) would delete
more than the item asked for. ``POST /v1/chains/{chain_id}/rewind`` drops whole turns explicitly.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.datastructures import State

from agentrt.chain_state import ChainState
from agentrt.chains import no_nul
from agentrt.chat import Message
from agentrt.conversations_items import (call_item_id, call_output_item, chain_id_of, check_order, check_pending,
                                         content_text, conversation_id_of, digest, history, item_text, message_item,
                                         new_item_id, output_ids, parse_item, stored_item, turn_output)
from agentrt.conversations_types import (ConversationCreate, ConversationItemList, ConversationNotFound,
                                         ConversationObject, ConversationUpdate, ItemNotFound)
from agentrt.errors import ChainBusy, ChainNotFound, bad_field
from agentrt.models import TurnRow
from agentrt.responses_types import FunctionCallItem, InputItem, MessageItem, ReasoningItem
from sdk.schema import ChainCreate

KEY = "agentrt_conversation"  # the chain metadata that makes a chain a conversation


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
                no_nul(content_text(item.content), f"{key}.content")
            stored = stored_item(item, key, new_item_id(item))
            assert stored is not None
            (system if stored.get("role") in ("system", "developer") else pending).append(stored)
        check_pending([(p, f"items[{len(system) + i}]") for i, p in enumerate(pending)])
        conv = {"metadata": data.metadata or {}, "system": system, "pending": pending, "turns": {}}
        system_prompt = "\n".join(item_text(s) for s in system) if system else None
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
                items.append(call_output_item(ids[k] if ids else f"fco_{where}_{k}", m["tool_call_id"], m["content"]))
            else:
                items.append(message_item(ids[k] if ids else f"msg_{where}_{k}", "user", m["content"]))
        key = (entry or {}).get("key") or where
        renderer = self.chains.renderer.renderer
        thinking = None
        if renderer.think is not None:
            thinking = entry["think"] if entry is not None and "think" in entry else \
                renderer.thinking(row.appended_token_ids)
        rs_id, msg_id = output_ids(key)
        calls = (entry or {}).get("fc") or []
        reader = self.chains.renderer.reader() if entry is None or entry["calls"] else None
        return items + turn_output(row.content, row.tool_calls, thinking, reader,
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
            stored = stored_item(item, key, new_item_id(item))
            assert stored is not None
            added.append(stored)
        async with self._lock:
            state = await self.state(conversation_id, tenant)
            _, pending, _ = await self._items(state)
            check_pending([(p, "conversation") for p in pending] + [(a, f"items[{i}]") for i, a in enumerate(added)])
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
            stored = stored_item(item, key, new_item_id(item))
            input_ids.append(None if stored is None else stored["id"])
            if stored is not None:
                given.append((stored, key))
        hist = history(given)
        if not hist.messages or hist.messages[-1]["role"] == "assistant":
            raise bad_field("input", "must end with a user message or function_call_output items (after the "
                                     "conversation's pending items): the response follows them")
        check_order(hist)
        entries: dict[str, dict[str, Any]] = {}
        turn, first = state.num_turns, 0
        reader = self.chains.renderer.reader()
        for i, message in enumerate(hist.messages):
            if message["role"] != "assistant":
                continue
            text_ids = [x for x in hist.ids[i] if x not in {c[0] for c in hist.calls[i]}]
            entries[str(turn)] = {"h": digest(hist.messages[first:i]), "in": [x for ids in hist.ids[first:i]
                                                                              for x in ids],
                                  "calls": True, "think": False,
                                  "msg": text_ids[0] if text_ids and reader.without_calls(message["content"]) else None,
                                  "fc": [list(c) for c in hist.calls[i]]}
            turn, first = turn + 1, i + 1
        key = uuid.uuid4().hex
        entries[str(turn)] = {"h": digest(hist.messages[first:]),
                              "in": [x for ids in hist.ids[first:] for x in ids], "key": key, "calls": parse_calls}
        return TurnPlan(conversation_id=conversation_id, state=state, messages=hist.messages, names=hist.names,
                        offset=first, entries=entries, key=key, input_ids=input_ids,
                        system_texts=[item_text(s) for s in conv.get("system") or []],
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


def _entry(conv: dict[str, Any], row: TurnRow) -> dict[str, Any] | None:
    entry = (conv.get("turns") or {}).get(str(row.index))
    if not isinstance(entry, dict) or entry.get("h") != digest(row.messages) \
            or len(entry.get("in") or []) != len(row.messages):
        return None
    return entry


def conversations_service(state: State) -> ConversationService:
    service = getattr(state, "conversations", None)
    if service is None:
        service = ConversationService(state.chains)
        state.conversations = service
    return service
