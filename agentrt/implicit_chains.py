"""Implicit chains: a client that re-sends the whole conversation with every request (Anthropic's Messages API,
OpenAI's chat completions without ``chain_id``) still gets a chain's resumed KV.

The server finds, among the tenant's implicit chains, the one whose history is the longest prefix of the
request's messages, and appends only the new part as a turn; a conversation it has not seen becomes a new
chain. Routes call ``ImplicitChains.resolve(tenant, session, system, tools, messages)`` with the messages as
the chain routes' message dicts (``{"role": "user", "content"}``, ``{"role": "tool", "content",
"tool_call_id", "name"}``, and for earlier replies ``{"role": "assistant", "content", "tool_calls": [{"id",
"type": "function", "function": {"name", "arguments"}}]}``), ending with a user or tool message; it yields the
chain id and the offset of the messages the caller's turn appends (see ``Resolved``).

**Matching** is at the message level against each chain's stored history (``ChainState.history``), never its
KV: the system prompt and the tools must be equal, then each message in order; an assistant message matches
the chain's turn either as generated (markup in the text) or as a route returned it (the text without its calls,
plus the calls' names and arguments, read in the model's tool-call syntax; call ids are not compared). Pruning
drops KV only, so a chain whose tool results were pruned still holds the client's results in its history and
still matches.

**Scope.** Candidates are looked up in memory, per tenant, by (session key, hash of the system prompt, the
tools and the first message): only the tenant's own chains of the same session (``None`` is a session of its
own) with the same start are compared, so another tenant's identical prefix never resumes a chain, and two
conversations of one tenant resume each other's chains only where their histories are equal message for
message (identical content; a session key separates even those). The index is rebuilt from the chains'
metadata (``agentrt_implicit``) the first time a tenant is seen after a start.

**Outcomes**, best first (the longest match wins, a whole-chain match over a fork at equal length, the most
recently used at equal rank):

- ``resumed``: the whole chain history is a prefix of the messages; the turn appends the rest.
- ``forked``: only the first ``k >= 1`` turns match (a client that retried or edited its last message): the
  chain is forked and the fork rewound to ``k`` turns (``ChainService.fork`` / ``rewind``: dense KV is kept),
  so the original stays intact for the conversation that owns it.
- ``created``: a new chain with the request's system prompt and tools.

A chain with a turn in flight (or being resolved for another request) is never resumed nor forked: the
request goes on to the next candidate, or to a new chain. Agent harnesses send parallel requests that share a
prefix; queueing them behind one another or refusing them (409) would stall or fail the client, while a new
chain only costs the recomputation of that prefix. Messages after the matched part that the chain cannot
append as a turn (assistant messages it did not generate: a history from elsewhere, or edited) are imported
first, one turn per assistant message: its preceding user and tool messages, and the assistant message as the
turn's ``assistant_prefix``, written as the template writes an earlier reply (``ChatRenderer.reply_form``),
closed by the stop token that ends a reply before the next message, forced as the turn's only generated token.

Each tenant keeps at most ``max_chains_per_tenant`` implicit chains; beyond, the least recently used idle one
is deleted (clients never name implicit chains, so nothing else ever would).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from agentrt.chain_state import ChainState
from agentrt.chat import Message
from agentrt.errors import ChainBusy, ChainNotFound, bad_field
from agentrt.tool_syntax import ToolCallReader
from agentrt.tool_syntax.base import arguments_value
from sdk.schema import ChainCreate, ForkRequest, RewindRequest, Tool, TurnCreate, TurnResult

if TYPE_CHECKING:
    from agentrt.chains import ChainService

log = logging.getLogger(__name__)
IMPLICIT_KEY = "agentrt_implicit"  # chain metadata: {"session": hash or None, "head": hash}
Outcome = Literal["resumed", "forked", "created"]


@dataclass(slots=True)
class Resolved:
    chain_id: str
    offset: int  # messages[offset:] (user and tool messages only) are the caller's turn
    how: Outcome
    state: ChainState  # the chain as the caller's turn finds it
    imported: list[TurnResult] = field(default_factory=list)  # turns that appended history the chain lacked


@dataclass(slots=True)
class _Match:
    chain_id: str
    state: ChainState
    turns: int  # whole turns matched
    offset: int  # messages matched by those turns
    whole: bool  # the chain's whole history matched


def session_hash(session: str | None) -> str | None:
    """Session keys are client identifiers: only a hash is kept, in the index and in chain metadata."""
    return None if session is None else hashlib.sha256(f"session\0{session}".encode()).hexdigest()[:32]


def _head(system: str, tools: list[dict[str, Any]], first: Message) -> str:
    key = [system, tools, first.get("role"), first.get("content"), first.get("tool_call_id")]
    return hashlib.sha256(msgspec.json.encode(key, order="sorted")).hexdigest()[:32]


def _sent_calls(message: Message) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], arguments_value(c["function"].get("arguments")))
            for c in message.get("tool_calls") or []]


def _kept_calls(raw: str, reader: ToolCallReader) -> list[tuple[str, Any]]:
    return [(c.function.name, arguments_value(c.function.arguments)) for c in reader.reply_calls(raw)]


def same_message(sent: Message, kept: Message, reader: ToolCallReader) -> bool:
    """Whether a request's message is the chain's history message ``kept`` (calls read by ``reader``)."""
    if sent.get("role") != kept.get("role"):
        return False
    if kept["role"] == "assistant":
        raw, text, calls = kept["content"], sent.get("content") or "", _sent_calls(sent)
        if not calls and text == raw:
            return True
        return text.strip() == reader.reply_content(raw) and calls == _kept_calls(raw, reader)
    if sent.get("content") != kept.get("content"):
        return False
    return kept["role"] != "tool" or sent.get("tool_call_id") == kept.get("tool_call_id")


def _match(state: ChainState, system: str, tools: list[dict[str, Any]], messages: list[Message],
           reader: ToolCallReader) -> _Match | None:
    if state.row.system_prompt != system or state.row.tools != tools:
        return None
    kept = state.history[1:]
    turns = offset = 0
    for i, message in enumerate(kept):
        if i >= len(messages) or not same_message(messages[i], message, reader):
            return _Match(state.id, state, turns, offset, False)
        if message["role"] == "assistant":
            turns, offset = turns + 1, i + 1
    return _Match(state.id, state, turns, offset, True)


def _turn_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        else:
            out.append({"role": "tool", "content": m["content"], "tool_call_id": m["tool_call_id"],
                        **({"name": m["name"]} if m.get("name") else {})})
    return out


def turn_create(messages: list[Message], sampling: dict[str, Any], assistant_prefix: str | None = None,
                stream: bool = False) -> TurnCreate:
    """The chain turn appending ``messages`` (user and tool message dicts); a 400 naming ``messages`` when a
    message breaks the turn's limits."""
    body = {"messages": _turn_messages(messages), "sampling": sampling, "stream": stream,
            "assistant_prefix": assistant_prefix}
    try:
        return msgspec.convert(body, TurnCreate)
    except msgspec.ValidationError as exc:
        raise bad_field("messages", str(exc)) from None


class ImplicitChains:
    def __init__(self, chains: ChainService, max_chains_per_tenant: int = 64):
        self.chains = chains
        self.max_chains_per_tenant = max_chains_per_tenant
        # tenant -> (session hash, head hash) -> chain ids; tenant -> chain ids, least recently used first
        self._index: dict[str, dict[tuple[str | None, str], set[str]]] = {}
        self._lru: dict[str, OrderedDict[str, tuple[str | None, str]]] = {}
        self._claimed: set[str] = set()  # chosen by a request that has not started its turn yet
        self._loaded: set[str] = set()
        self._seen: dict[str, float] = {}  # tenant -> the creation time of the newest chain read from the database
        self._loading = asyncio.Lock()
        self._reply_forms: dict[str, tuple[str, int | None]] = {}  # ChatRenderer.reply_form by the next role

    # --- the lookup ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def resolve(self, tenant: str, session: str | None, system: str | None, tools: list[dict[str, Any]],
                      messages: list[Message], names: Sequence[str] | None = None) -> AsyncIterator[Resolved]:
        """The chain for ``messages`` (resumed, forked or created, history imported), held for the caller until
        the block exits: start the turn of ``messages[offset:]`` inside it (``ChainService.start_turn`` marks
        the chain busy; until then no other request takes it). ``names[i]``: the request field of
        ``messages[i]``, for errors (default ``messages[i]``)."""
        names = names or [f"messages[{i}]" for i in range(len(messages))]
        if not messages or messages[-1]["role"] == "assistant":
            raise bad_field("messages", "must end with a user message or tool results")
        if messages[0]["role"] == "assistant":
            raise bad_field(f"{names[0]}.role", "the first message must be a user message")
        system = self.chains.config.default_system_prompt if system is None else system
        tools = msgspec.to_builtins(msgspec.convert(tools or [], list[Tool]))
        key = (session_hash(session), _head(system, tools, messages[0]))
        await self._load(tenant)
        held: set[str] = set()
        made: str | None = None  # a chain this request created or forked: gone again if the request fails
        try:
            match = await self._best(tenant, key, system, tools, messages, held)
            if match is None:
                chain_id = made = await self._create(tenant, key, system, tools, held)
                how, offset = "created", 0
            elif match.whole:
                chain_id, how, offset = match.chain_id, "resumed", match.offset
            else:
                chain_id = made = await self._fork(tenant, key, match, held)
                how, offset = "forked", match.offset
            self._touch(tenant, chain_id)
            await self._evict(tenant)
            imported, offset = await self.import_history(tenant, chain_id, messages, offset, names)
            state = await self.chains.state(chain_id, tenant)
            yield Resolved(chain_id=chain_id, offset=offset, how=how, state=state, imported=imported)
        except BaseException:
            if made is not None:  # a refused request leaves no chain behind
                await self._discard(tenant, made)
            raise
        finally:
            self._claimed -= held

    async def peek(self, tenant: str, system: str | None, tools: list[dict[str, Any]],
                   messages: list[Message]) -> tuple[ChainState, int] | None:
        """Read-only: the tenant's chain, of any session, whose whole history ``messages`` continue (busy or not),
        and the offset of the rest; None when there is none (for counting tokens as the engine would see them)."""
        if not messages:
            return None
        system = self.chains.config.default_system_prompt if system is None else system
        tools = msgspec.to_builtins(msgspec.convert(tools or [], list[Tool]))
        head = _head(system, tools, messages[0])
        await self._load(tenant)
        best: _Match | None = None
        ids = [c for (_, h), chains in self._index.get(tenant, {}).items() if h == head for c in chains]
        for chain_id in ids:
            match = await self._compare(tenant, chain_id, system, tools, messages)
            if match is not None and match.whole and (best is None or match.offset > best.offset):
                best = match
        return None if best is None else (best.state, best.offset)

    async def _compare(self, tenant: str, chain_id: str, system: str, tools: list[dict[str, Any]],
                       messages: list[Message]) -> _Match | None:
        try:
            state = await self.chains.state(chain_id, tenant)
        except ChainNotFound:  # deleted through the chain routes
            self._forget(tenant, chain_id)
            return None
        return _match(state, system, tools, messages, self.chains.renderer.reader(tools))

    def _available(self, chain_id: str) -> bool:
        return chain_id not in self._claimed and self.chains.status(chain_id) == "idle"

    async def _best(self, tenant: str, key: tuple[str | None, str], system: str, tools: list[dict[str, Any]],
                    messages: list[Message], held: set[str]) -> _Match | None:
        candidates = self._index.get(tenant, {}).get(key, set())
        ids = [c for c in reversed(self._lru.get(tenant, OrderedDict())) if c in candidates]
        best: _Match | None = None
        for chain_id in ids:  # most recently used first: it wins ties
            if not self._available(chain_id):
                continue
            match = await self._compare(tenant, chain_id, system, tools, messages)
            if match is None or not (match.whole or match.turns >= 1):
                continue
            if best is None or (match.offset, match.whole) > (best.offset, best.whole):
                best = match
        if best is None or not self._available(best.chain_id):  # taken while other chains' states were read
            return None if best is None else await self._best(tenant, key, system, tools, messages, held)
        self._claimed.add(best.chain_id)
        held.add(best.chain_id)
        return best

    # --- new chains --------------------------------------------------------------------------------------
    async def _create(self, tenant: str, key: tuple[str | None, str], system: str, tools: list[dict[str, Any]],
                      held: set[str]) -> str:
        data = msgspec.convert({"system_prompt": system, "tools": tools, "metadata": _metadata(key)}, ChainCreate)
        chain = await self.chains.create(data, tenant=tenant)
        self._claimed.add(chain.id)
        held.add(chain.id)
        self._add(tenant, chain.id, key)
        return chain.id

    async def _fork(self, tenant: str, key: tuple[str | None, str], match: _Match, held: set[str]) -> str:
        fork = await self.chains.fork(match.chain_id, ForkRequest(metadata=_metadata(key)), tenant=tenant)
        self._claimed.add(fork.id)
        held.add(fork.id)
        self._add(tenant, fork.id, key)
        try:
            await self.chains.rewind(fork.id, RewindRequest(num_turns=match.turns), tenant=tenant)
        except BaseException:
            await self._discard(tenant, fork.id)
            raise
        return fork.id

    async def import_history(self, tenant: str, chain_id: str, messages: list[Message], start: int,
                      names: Sequence[str]) -> tuple[list[TurnResult], int]:
        """Append ``messages[start:]`` up to its last assistant message as turns; the offset of the rest."""
        results: list[TurnResult] = []
        first = start
        for i in range(start, len(messages)):
            if messages[i]["role"] != "assistant":
                continue
            if i == first:
                raise bad_field(f"{names[i]}.role", "an assistant message must follow a user message or tool "
                                                    "results")
            next_role = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
            lead, end = self._reply_form(next_role)
            if end is None:
                raise bad_field(names[i], "this model's chat template cannot take an assistant message that this "
                                          "server did not generate")
            data = turn_create(messages[first:i], {"temperature": 0.0, "max_tokens": 1, "forced_token_ids": [end]},
                               assistant_prefix=lead + self._generated_text(messages[i]))
            turn = await self.chains.start_turn(chain_id, data, tenant=tenant)
            try:
                results.append(await turn.result())
            finally:
                await turn.close()
            first = i + 1
        return results, first

    def _generated_text(self, message: Message) -> str:
        """An assistant message as the model generates one: its text, then its calls in the model's syntax."""
        syntax = self.chains.renderer.renderer.tool_syntax
        return syntax.spell(message.get("content") or "", message.get("tool_calls") or [])

    def _reply_form(self, next_role: str) -> tuple[str, int | None]:
        """``ChatRenderer.reply_form``, looked up once per role."""
        role = "tool" if next_role == "tool" else "user"
        if role not in self._reply_forms:
            self._reply_forms[role] = self.chains.renderer.renderer.reply_form(role)
        return self._reply_forms[role]

    # --- the index ------------------------------------------------------------------------------------
    def _add(self, tenant: str, chain_id: str, key: tuple[str | None, str]) -> None:
        self._index.setdefault(tenant, {}).setdefault(key, set()).add(chain_id)
        self._lru.setdefault(tenant, OrderedDict())[chain_id] = key

    def _forget(self, tenant: str, chain_id: str) -> None:
        key = self._lru.get(tenant, OrderedDict()).pop(chain_id, None)
        if key is not None:
            ids = self._index[tenant][key]
            ids.discard(chain_id)
            if not ids:
                del self._index[tenant][key]

    def _touch(self, tenant: str, chain_id: str) -> None:
        self._lru[tenant].move_to_end(chain_id)

    async def _discard(self, tenant: str, chain_id: str) -> None:
        self._forget(tenant, chain_id)
        try:
            await self.chains.delete(chain_id, tenant=tenant)
        except Exception:  # the request's own error is what the client gets
            log.warning("could not delete implicit chain %s", chain_id, exc_info=True)

    async def _evict(self, tenant: str) -> None:
        lru = self._lru.get(tenant, OrderedDict())
        while len(lru) > self.max_chains_per_tenant:
            victim = next((c for c in lru if self._available(c)), None)
            if victim is None:
                return
            self._forget(tenant, victim)
            try:
                await self.chains.delete(victim, tenant=tenant)
            except (ChainNotFound, ChainBusy):
                pass

    async def _load(self, tenant: str) -> None:
        """Index the tenant's implicit chains from the database, once per tenant and process; when other HTTP
        replicas make chains too (``ChainService.leases``), also those made since the last look, each time."""
        shared = self.chains.leases is not None
        if tenant in self._loaded and not shared:
            return
        async with self._loading:
            if tenant in self._loaded and not shared:
                return
            since = self._seen.get(tenant)
            found: list[tuple[str, tuple[str | None, str]]] = []  # oldest first
            for chain_id, meta, created_at in await self.chains.created_since(tenant, since):
                info = meta.get(IMPLICIT_KEY)
                if isinstance(info, dict) and isinstance(info.get("head"), str):
                    found.append((chain_id, (info.get("session"), info["head"])))
                self._seen[tenant] = created_at
            for chain_id, key in found if since is not None else reversed(found):
                if chain_id not in self._lru.get(tenant, {}):
                    self._add(tenant, chain_id, key)
                    if since is None:  # older than any chain made here since the start
                        self._lru[tenant].move_to_end(chain_id, last=False)
            self._loaded.add(tenant)


def implicit_chains_of(state: Any) -> ImplicitChains:
    """The app's ImplicitChains, made on first use from ``app.state.chains``: one index per app, shared by every
    route that resolves implicit chains."""
    implicit = getattr(state, "implicit_chains", None)
    if implicit is None:
        implicit = implicit_chains_for(state.chains)
        state.implicit_chains = implicit
    return implicit


def implicit_chains_for(chains: ChainService) -> ImplicitChains:
    """The ImplicitChains over ``chains``, made on first use: one index per ChainService, so every route (the
    Anthropic route through ``implicit_chains_of``, the OpenAI route with its ChainService) shares it."""
    implicit = getattr(chains, "implicit_chains", None)
    if implicit is None:
        implicit = ImplicitChains(chains)
        chains.implicit_chains = implicit  # type: ignore[attr-defined]
    return implicit


def _metadata(key: tuple[str | None, str]) -> dict[str, Any]:
    return {IMPLICIT_KEY: {"session": key[0], "head": key[1]}}
