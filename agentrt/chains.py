"""Chains as resources: create, list, read, delete, and starting a turn (see agentrt.turns for the rest)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from sqlalchemy import delete, func, inspect, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from agentrt.chain_state import (ChainState, chain_read, chain_summary, kv_accounting, message_dict, policy_of,
                                 prune_event_row, state_from_rows)
from agentrt.render_pool import RenderPool
from agentrt.completions import structured_spec
from agentrt.config import ServerConfig
from agentrt.db import Database
from agentrt.engine_worker import EngineUnavailable, EngineWorker
from agentrt.errors import ChainBusy, ChainNotFound, TooManyChains, TooManyMethodConfigs, bad_field
from agentrt.metrics import Metrics
from agentrt.scaleout.leases import ChainLeases, Lease
from agentrt.tool_input_spans import covered
from agentrt.models import ChainRow, PruneEventRow, RegionRow, TurnRow
from agentrt.turns import PendingTurn
from engine.chain_index import ChainInfo, UnknownChainError
from engine.errors import ConfigError, EngineError, InvalidRequestError
from engine.registry import METHODS, SCORERS, create_method
from engine.sampling_params import SamplingParams
from sdk.schema import (ChainCreate, ChainStatus, ChainList, ChainRead, ChainSummary, ForkRequest, HintsRequest,
                        PruneEvent, PruneRequest, PruneResult, Region, RewindRequest, ToolResultMessage, TurnCreate,
                        TurnHints)

if TYPE_CHECKING:
    from engine.engine_handle import EngineHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
MethodKey = tuple[str, str]  # (method, its config as canonical JSON)


def method_key(method: str, config: dict[str, Any]) -> MethodKey:
    return method, msgspec.json.encode(config, order="sorted").decode()


def no_nul(value: str | None, key: str) -> None:
    """Client-given names and prompts may not hold NUL (400 naming the field): no client needs one there, and
    refusing it at the boundary keeps what the server stores the same on every database."""
    if value is not None and "\x00" in value:
        raise bad_field(key, "must not contain NUL (\\u0000)")


class ChainService:
    def __init__(self, config: ServerConfig, model_name: str, worker: EngineWorker, renderer: RenderPool,
                 db: Database, leases: ChainLeases | None = None):
        """``leases``: chains are shared with other HTTP replicas (agentrt.scaleout): a chain is held through its
        lease in the database, not only in ``busy``, and its state is read from the database each time, since
        another replica may have changed it."""
        self.config = config
        self.leases = leases
        self._leases: dict[str, Lease] = {}  # the leases this replica holds now
        self._releasing: set[asyncio.Task] = set()
        self.model_name = model_name
        self.worker = worker
        self.renderer = renderer
        self.db = db
        self.metrics: Metrics | None = None
        self.states: dict[str, ChainState] = {}
        self.busy: set[str] = set()
        self.num_chains = 0
        self._creating = asyncio.Lock()  # the per-tenant chain count and the insert that follows it
        # method configurations other than the server's, and the chains using them: each holds one of the
        # engine's max_methods slots (retain_method) from its first chain until its last is deleted
        self._method_chains: dict[MethodKey, int] = {}
        self._tenant_methods: dict[str, dict[MethodKey, int]] = {}
        self._retained: set[MethodKey] = set()  # those the engine holds for the chains now

    async def start(self) -> None:
        """Count the chains, and retain the method configuration of every chain in the database: chains outlive
        the engine, and their slots must not go to other tenants' chains after a restart."""
        async with self.db.sessions() as s:
            self.num_chains = await s.scalar(select(func.count()).select_from(ChainRow)) or 0
            rows = (await s.execute(select(ChainRow.tenant, ChainRow.method, ChainRow.method_config))).all()
        for tenant, method, config in rows:
            self._count_method(tenant, method_key(method, config), +1)
        for key in list(self._method_chains):
            try:
                await self._retain(key)
            except ConfigError as exc:  # its chains' turns are 400s naming `method` until it can be retained
                log.warning("method %s %s of existing chains cannot run on this engine: %s", key[0], key[1], exc)

    def counts(self) -> tuple[int, int]:
        return len(self.busy), self.num_chains

    def status(self, chain_id: str) -> ChainStatus:
        return "busy" if chain_id in self.busy else "idle"

    # --- CRUD -----------------------------------------------------------------------------------
    async def _check_quota(self, tenant: str) -> None:
        """Call holding ``self._creating``: 429 when the tenant is at its chain limit."""
        limit = self.config.max_chains_per_tenant
        if limit is None:
            return
        async with self.db.sessions() as s:
            n = await s.scalar(select(func.count()).select_from(ChainRow).where(ChainRow.tenant == tenant)) or 0
        if n >= limit:
            raise TooManyChains(tenant, limit)

    async def create(self, data: ChainCreate, *, tenant: str) -> ChainRead:
        if data.model is not None and data.model != self.model_name:
            raise bad_field("model", f"this server serves {self.model_name!r}, not {data.model!r}")
        no_nul(data.system_prompt, "system_prompt")
        for i, tool in enumerate(data.tools):
            no_nul(tool.function.name, f"tools[{i}].function.name")
        if data.prune_policy is not None:
            for i, name in enumerate(data.prune_policy.exclude_tools):
                no_nul(name, f"prune_policy.exclude_tools[{i}]")
        method, method_config = self._chain_method(data.method, data.method_config)
        tools = msgspec.to_builtins(data.tools)
        row = ChainRow(id=f"chain_{uuid.uuid4().hex}", created_at=time.time(), model=self.model_name,
                       method=method, method_config=method_config,
                       system_prompt=data.system_prompt if data.system_prompt is not None
                       else self.config.default_system_prompt,
                       tools=tools, meta=data.metadata, num_turns=0, num_tokens=0,
                       prune_policy=None if data.prune_policy is None else msgspec.to_builtins(data.prune_policy),
                       pruned_intervals=[], tenant=tenant)
        if data.prune_policy is not None:
            policy = data.prune_policy
            if policy.scorer is not None:
                self._check_scorer(policy.scorer, "prune_policy.scorer")
            _check_keep(policy.scorer, policy.keep_ratio, policy.keep_tokens, "prune_policy.")
        await self.renderer.render([{"role": "system", "content": row.system_prompt}], tools)
        key = method_key(method, method_config)
        async with self._creating:
            await self._check_quota(tenant)
            await self._take_method(tenant, key, "method_config" if data.method_config is not None else "method")
            try:
                async with self.db.sessions.begin() as s:
                    s.add(row)
            except BaseException:
                await self._give_back_method(tenant, key)
                raise
        self.num_chains += 1
        if self.leases is None:
            self.states[row.id] = ChainState(row=row)
        return chain_read(row, "idle", [], [], kv_accounting(0, None), False, [])

    async def page(self, offset: int, limit: int, *, tenant: str) -> ChainList:
        async with self.db.sessions() as s:
            total = await s.scalar(select(func.count()).select_from(ChainRow).where(ChainRow.tenant == tenant)) or 0
            rows = (await s.scalars(select(ChainRow).where(ChainRow.tenant == tenant)
                                    .order_by(ChainRow.created_at, ChainRow.id).offset(offset).limit(limit))).all()
        data: list[ChainSummary] = [chain_summary(r, self.status(r.id)) for r in rows]
        return ChainList(data=data, offset=offset, limit=limit, total=total, has_more=offset + len(rows) < total)

    async def created_since(self, tenant: str, since: float | None) -> list[tuple[str, dict[str, Any], float]]:
        """(id, metadata, created_at) of the tenant's chains created after ``since`` (None: all), oldest first."""
        query = select(ChainRow.id, ChainRow.meta, ChainRow.created_at).where(ChainRow.tenant == tenant)
        if since is not None:
            query = query.where(ChainRow.created_at >= since)
        async with self.db.sessions() as s:
            rows = (await s.execute(query.order_by(ChainRow.created_at, ChainRow.id))).all()
        return [(r.id, r.meta, r.created_at) for r in rows]

    async def read(self, chain_id: str, include_tokens: bool = False, *, tenant: str) -> ChainRead:
        chain, turns, regions = await self.rows(chain_id, tenant)
        async with self.db.sessions() as s:
            events = (await s.scalars(select(PruneEventRow).where(PruneEventRow.chain_id == chain_id)
                                      .order_by(PruneEventRow.index))).all()
        kv = kv_accounting(chain.num_tokens, await self._chain_info(chain_id))
        return chain_read(chain, self.status(chain_id), turns, regions, kv, include_tokens, list(events))

    async def delete(self, chain_id: str, *, tenant: str) -> None:
        state = await self.state(chain_id, tenant)  # 404 for another tenant's chain before anything else (no 409 leak)
        await self._hold(chain_id)
        try:
            async with self.db.sessions.begin() as s:
                await self.fence(s, chain_id)
                if await s.get(ChainRow, chain_id) is None:
                    raise ChainNotFound(chain_id)
                await s.execute(delete(RegionRow).where(RegionRow.chain_id == chain_id))
                await s.execute(delete(PruneEventRow).where(PruneEventRow.chain_id == chain_id))
                await s.execute(delete(TurnRow).where(TurnRow.chain_id == chain_id))
                await s.execute(delete(ChainRow).where(ChainRow.id == chain_id))
            self.states.pop(chain_id, None)
            self.num_chains -= 1
            try:
                await self._engine_call(lambda e: e.delete_chain(chain_id), chain_id)
            finally:
                await self._give_back_method(state.row.tenant, method_key(state.row.method, state.row.method_config))
                if self.leases is not None:
                    await self.leases.forget(chain_id)
        finally:
            self._let_go(chain_id)

    # --- turns ----------------------------------------------------------------------------------
    async def start_turn(self, chain_id: str, data: TurnCreate, *, tenant: str) -> PendingTurn:
        """Render, submit and return the running turn; raises 404 / 409 / 400 / 422 / 503 before anything
        changes."""
        state = await self.state(chain_id, tenant)
        no_nul(data.assistant_prefix, "assistant_prefix")
        for i, m in enumerate(data.messages):
            if isinstance(m, ToolResultMessage):
                no_nul(m.tool_call_id, f"messages[{i}].tool_call_id")
                no_nul(m.name, f"messages[{i}].name")
        await self._hold(chain_id)
        try:
            if self.leases is not None:  # another replica may have run a turn since the read above
                state = await self.state(chain_id, tenant)
            key = method_key(state.row.method, state.row.method_config)
            if key in self._method_chains and key not in self._retained:
                await self._retain(key)  # not retained at start (the engine could not take it on then)
            params = self._sampling(data, state.row.tools)
            if params.max_tokens != data.sampling.max_tokens:  # lowered (fit_max_tokens): recorded as it ran
                data = msgspec.structs.replace(data, sampling=msgspec.structs.replace(data.sampling,
                                                                                      max_tokens=params.max_tokens))
            messages = [message_dict(m) for m in data.messages]
            for m in messages:
                if m["role"] == "tool" and m.get("name") is None:
                    m["name"] = state.tool_names.get(m["tool_call_id"])
            new = ([state.system_message()] if state.num_turns == 0 else []) + messages
            last = state.token_ids[-1] if state.token_ids else None
            appended = await self.renderer.append(state.history, new, state.row.tools, last, data.assistant_prefix,
                                                  log_ids=state.token_ids)
            if appended.dropped:
                state = await self._drop_reasoning(state, appended.dropped)
            prompt = state.token_ids + appended.token_ids
            stream = await self.worker.submit(prompt, params, chain_id=chain_id,
                                              method=(state.row.method, state.row.method_config))
        except ConfigError as exc:  # the chain's method cannot run on this server (e.g. restarted otherwise)
            self._let_go(chain_id)
            raise bad_field("method", f"the chain's method {state.row.method!r} cannot run here: {exc}") from None
        except BaseException:
            self._let_go(chain_id)
            raise
        return PendingTurn(self, state, data, messages, appended, prompt, stream)

    def finish_turn(self, chain_id: str, new_state: ChainState | None) -> None:
        if new_state is not None and self.leases is None:
            self.states[chain_id] = new_state
        self._let_go(chain_id)

    async def fence(self, session: AsyncSession, chain_id: str, engine_replica: str | None = None,
                    release: bool = False) -> None:
        """In a transaction writing a chain this replica holds: with leases, raise
        agentrt.scaleout.leases.LeaseLost (nothing is written) when the lease expired and another request took
        the chain; else record ``engine_replica`` as the chain's owner (a turn's commit) and, with ``release``,
        give the lease back in the same transaction."""
        lease = self._leases.get(chain_id)
        if self.leases is None or lease is None:
            return
        await self.leases.fence(session, lease, engine_replica, release)
        if release:
            self._leases.pop(chain_id, None)

    async def release(self, chain_id: str) -> None:
        """Give the chain's lease back now (awaited: the client's next request may reach another HTTP replica at
        once); ``busy`` is left to ``finish_turn``."""
        lease = self._leases.pop(chain_id, None)
        if self.leases is not None and lease is not None:
            try:
                await self.leases.release(lease)
            except Exception:  # noqa: BLE001 -- it expires after its TTL
                log.exception("releasing the lease of %s failed", chain_id)

    async def state(self, chain_id: str, tenant: str | None = None) -> ChainState:
        """The chain's state; ChainNotFound when it does not exist or (``tenant`` given) belongs to another."""
        state = self.states.get(chain_id) if self.leases is None else None
        if state is None:
            state = state_from_rows(*await self.rows(chain_id))
            if self.leases is None:
                state = self.states.setdefault(chain_id, state)
        if tenant is not None and state.row.tenant != tenant:
            raise ChainNotFound(chain_id)
        return state

    # --- prune / fork / rewind ------------------------------------------------------------------
    async def _hold(self, chain_id: str) -> None:
        """Hold the chain for one operation (ChainBusy when something holds it already): in this process, and
        with leases in the database too, so no other HTTP replica runs it meanwhile."""
        if chain_id in self.busy:
            raise ChainBusy(chain_id)
        self.busy.add(chain_id)
        if self.leases is not None:
            try:
                self._leases[chain_id] = await self.leases.acquire(chain_id)
            except BaseException:
                self.busy.discard(chain_id)
                raise

    def _let_go(self, chain_id: str) -> None:
        self.busy.discard(chain_id)
        lease = self._leases.pop(chain_id, None)
        if self.leases is not None and lease is not None:
            task = asyncio.ensure_future(self.leases.release(lease))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def prune(self, chain_id: str, data: PruneRequest, *, tenant: str) -> PruneResult:
        state = await self.state(chain_id, tenant)
        await self._hold(chain_id)
        try:
            if self.leases is not None:
                state = await self.state(chain_id, tenant)
            if data.scorer is not None:
                self._check_scorer(data.scorer, "scorer")
            _check_keep(data.scorer, data.keep_ratio, data.keep_tokens)
            info = await self._chain_info(chain_id)
            computed = info.computed_tokens if info is not None else 0
            selector = (data.regions, data.kinds, data.tool_names, data.rounds)
            if data.intervals is not None:
                if any(x is not None for x in selector):
                    raise bad_field("intervals", "give either intervals or a region selector, not both")
                if not data.intervals:
                    raise bad_field("intervals", "must not be empty")
                limit = computed if info is not None else len(state.token_ids)
                for i, (lo, hi) in enumerate(data.intervals):
                    if not lo < hi <= limit:
                        raise bad_field(f"intervals[{i}]", f"[{lo}, {hi}) must satisfy 0 <= L < R <= {limit} "
                                                           "(the chain's computed KV)")
                intervals = [(int(lo), int(hi)) for lo, hi in data.intervals]
                touched = [r.index for r in state.regions if any(lo < r.end and r.start < hi for lo, hi in intervals)]
            else:
                if all(x is None for x in selector):
                    raise bad_field("intervals", "give intervals or a region selector (regions, kinds, tool_names, "
                                                 "rounds)")
                for i, index in enumerate(data.regions or []):
                    if index >= len(state.regions):
                        raise bad_field(f"regions[{i}]", f"the chain has {len(state.regions)} regions")
                touched = [r.index for r in state.regions if _selected(r, data)]
                intervals = _region_intervals([r for r in state.regions if r.index in touched], computed,
                                              merge=data.keep_tokens is None)
            event, state = await self._prune(state, intervals, touched, data.scorer, data.keep_ratio, "explicit",
                                             info, data.keep_tokens)
            if self.leases is None:
                self.states[chain_id] = state
        finally:
            self._let_go(chain_id)
        regions = [state.regions[i] for i in event.regions]
        return PruneResult(chain_id=chain_id, tokens_kept=event.tokens_kept, tokens_freed=event.tokens_freed,
                           pages_freed=event.pages_freed, event=event, regions=regions)

    async def _drop_reasoning(self, state: ChainState, spans: list[tuple[int, int]]) -> ChainState:
        """The think blocks that the chat template leaves out of the conversation (agentrt.chat: Qwen3's drops
        earlier replies' reasoning) leave the chain's KV, as a prune: the token log keeps them, so the turn
        appends only its new messages and the model attends as the template shows the conversation. Call
        holding the chain."""
        info = await self._chain_info(state.id)
        if info is None:  # no KV here: the turn recomputes the whole log, blocks included (as any prune is lost)
            return state
        pruned = [(int(lo), int(hi)) for lo, hi in state.row.pruned_intervals or []]
        due = [(lo, min(hi, info.computed_tokens)) for lo, hi in spans
               if lo < info.computed_tokens and not covered((lo, hi), pruned)]
        if not due:
            return state
        touched = [r.index for r in state.regions if any(lo < r.end and r.start < hi for lo, hi in due)]
        _, state = await self._prune(state, due, touched, None, 0.0, "template", info)
        return state

    async def apply_policy(self, state: ChainState) -> tuple[list[PruneEvent], ChainState]:
        """Right after a turn that appended a tool-result round commits (the chain is still held busy)."""
        policy = policy_of(state.row)
        if policy is None or state.tool_rounds == 0:
            return [], state
        newest = state.tool_rounds - 1
        live = [r for r in state.regions if r.kind == "tool_result" and not r.pruned
                and r.tool_name not in policy.exclude_tools]
        if sum(r.end - r.start for r in live) < policy.min_tool_tokens:
            return [], state
        due = [r for r in live if r.round is not None and r.round <= newest - policy.lag]
        if not due:
            return [], state
        info = await self._chain_info(state.id)
        computed = info.computed_tokens if info is not None else 0
        intervals = _region_intervals(due, computed, merge=policy.keep_tokens is None)
        if info is None or not intervals:
            return [], state
        event, state = await self._prune(state, intervals, [r.index for r in due], policy.scorer, policy.keep_ratio,
                                         "policy", info, policy.keep_tokens)
        return [event], state

    async def _prune(self, state: ChainState, intervals: list[tuple[int, int]], touched: list[int],
                     scorer: str | None, keep_ratio: float, source: str, info: ChainInfo | None,
                     keep_tokens: int | None = None) -> tuple[PruneEvent, ChainState]:
        """With ``keep_tokens`` each interval keeps that many of its tokens (one engine prune per interval);
        with ``keep_ratio`` one prune keeps that share of them all."""
        chain_id = state.id
        pages_before = info.pages_held if info is not None else 0
        computed = info.computed_tokens if info is not None else 0
        tokens_kept = tokens_freed = pages_freed = 0
        if info is not None and intervals:
            calls = [intervals] if keep_tokens is None else [[iv] for iv in intervals]
            try:
                for part in calls:
                    res = await self.worker.call(lambda e, part=part: e.prune_chain(
                        chain_id, part, scorer, keep_ratio, keep_tokens=keep_tokens), chain=chain_id)
                    tokens_kept, tokens_freed = res.tokens_kept, tokens_freed + res.tokens_freed
                    pages_freed += res.pages_freed
            except UnknownChainError:
                pass
        after = await self._chain_info(chain_id) if info is not None else None
        pages_after = after.pages_held if after is not None else 0
        regions = list(state.regions)
        changed: list[Region] = []
        if tokens_freed > 0:
            for i in touched:
                r = regions[i]
                overlap = sum(max(0, min(hi, r.end) - max(lo, r.start)) for lo, hi in intervals)
                if overlap == 0:
                    continue
                if keep_tokens is None:
                    kept = max(0, r.kept_tokens - round((1.0 - keep_ratio) * overlap))
                else:  # each interval's drop shared by its regions in proportion to their overlap
                    kept = r.kept_tokens - sum(
                        round(max(0, (hi - lo) - keep_tokens) * max(0, min(hi, r.end) - max(lo, r.start)) / (hi - lo))
                        for lo, hi in intervals)
                    kept = max(0, kept)
                whole = overlap >= min(r.end, computed) - r.start  # all of it that has KV
                regions[i] = msgspec.structs.replace(r, pruned=r.pruned or whole, kept_tokens=kept)
                changed.append(regions[i])
        pruned_intervals = list(state.row.pruned_intervals or []) + ([list(iv) for iv in intervals]
                                                                      if tokens_freed > 0 else [])
        async with self.db.sessions.begin() as s:
            await self.fence(s, chain_id)
            index = await s.scalar(select(func.count()).select_from(PruneEventRow)
                                   .where(PruneEventRow.chain_id == chain_id)) or 0
            event = PruneEvent(index=index, source=source, created_at=time.time(), after_turn=state.num_turns,  # type: ignore[arg-type]
                               intervals=intervals, regions=touched, scorer=scorer, keep_ratio=keep_ratio,
                               keep_tokens=keep_tokens,
                               tokens_kept=tokens_kept, tokens_freed=tokens_freed, pages_freed=pages_freed,
                               pages_before=pages_before, pages_after=pages_after)
            s.add(prune_event_row(chain_id, event))
            for r in changed:
                await s.execute(update(RegionRow).where(RegionRow.chain_id == chain_id, RegionRow.index == r.index)
                                .values(pruned=r.pruned, kept_tokens=r.kept_tokens))
            await s.execute(update(ChainRow).where(ChainRow.id == chain_id).values(pruned_intervals=pruned_intervals))
        state.row.pruned_intervals = pruned_intervals
        if self.metrics is not None:
            self.metrics.record_prune(tokens_freed)
        return event, dataclasses.replace(state, regions=regions)

    async def fork(self, chain_id: str, data: ForkRequest, *, tenant: str) -> ChainRead:
        parent = await self.state(chain_id, tenant)
        key = method_key(parent.row.method, parent.row.method_config)
        await self._creating.acquire()
        try:
            await self._check_quota(tenant)
            await self._hold(chain_id)
        except BaseException:
            self._creating.release()
            raise
        new_id = f"chain_{uuid.uuid4().hex}"
        forked = False
        try:
            chain, turns, regions = await self.rows(chain_id)
            try:
                await self.worker.call(lambda e: e.fork_chain(chain_id, new_id), chain=chain_id)
                forked = True
            except (UnknownChainError, EngineError):  # not resident or no room: the fork recomputes its KV
                pass
            try:
                async with self.db.sessions.begin() as s:
                    await self.fence(s, chain_id)
                    events = (await s.scalars(select(PruneEventRow).where(PruneEventRow.chain_id == chain_id))).all()
                    s.add(_clone(chain, id=new_id, created_at=time.time(), parent_id=chain_id,
                                 meta=chain.meta if data.metadata is None else data.metadata,
                                 pruned_intervals=list(chain.pruned_intervals or []) if forked else []))
                    await s.flush()
                    s.add_all(_clone(t, chain_id=new_id) for t in turns)
                    s.add_all(_clone(r, chain_id=new_id, **({} if forked else
                                                           {"pruned": False, "kept_tokens": r.end - r.start}))
                              for r in regions)
                    s.add_all(_clone(e, chain_id=new_id) for e in events)
            except BaseException:
                if forked:
                    await self._engine_call(lambda e: e.delete_chain(new_id), chain_id)
                raise
            if forked and self.leases is not None:  # the copy is on its parent's engine replica
                await self.leases.set_owner(new_id, await self.leases.owner(chain_id))
            self.num_chains += 1
            self._count_method(tenant, key, +1)  # the parent's configuration: already the tenant's, retained
        finally:
            self._creating.release()
            self._let_go(chain_id)
        return await self.read(new_id, tenant=tenant)

    async def apply_turn_hints(self, chain_id: str, hints: TurnHints) -> None:
        """A turn's hints (``TurnCreate.hints``), once it has ended; a failure is logged, the turn stands."""
        def apply(e: EngineHandle) -> None:
            if hints.pin is not None:
                e.pin_chain(chain_id, hints.pin)
            if hints.priority is not None or hints.ttl_seconds is not None:
                e.chain_hints(chain_id, priority=hints.priority, ttl_s=hints.ttl_seconds)
            if hints.release_after:
                e.release_chain(chain_id)

        try:
            await self.worker.call(apply, chain=chain_id)
        except Exception:
            log.exception("session hints of chain %s were not applied", chain_id)

    async def hints(self, chain_id: str, data: HintsRequest, *, tenant: str) -> ChainRead:
        """Session hints on the chain's KV in the engine (``HintsRequest``); a chain the engine does not hold yet
        (never run here, or before its first turn after a restart) takes them with its next turn's KV: the pin and
        priority are applied as soon as the engine knows it."""
        await self.state(chain_id, tenant)
        if data.release and data.prefetch:
            raise bad_field("release", "release and prefetch exclude each other")
        if data.ttl_seconds is not None and data.clear_ttl:
            raise bad_field("clear_ttl", "ttl_seconds and clear_ttl exclude each other")
        if data.release and data.pin:
            raise bad_field("release", "a pinned chain is never released: leave one of pin and release out")
        pinned_before = False

        def apply(e: EngineHandle) -> None:
            nonlocal pinned_before
            if data.release and data.pin is None and e.chain_info(chain_id).pinned:
                pinned_before = True  # refused before any hint applies
                return
            if data.pin is not None:
                e.pin_chain(chain_id, data.pin)
            if data.priority is not None or data.ttl_seconds is not None or data.clear_ttl:
                e.chain_hints(chain_id, priority=data.priority, ttl_s=data.ttl_seconds, clear_ttl=data.clear_ttl)
            if data.release:
                e.release_chain(chain_id)
            if data.prefetch:
                e.prefetch_chain(chain_id)

        try:
            await self.worker.call(apply, chain=chain_id)
        except UnknownChainError:
            pass
        if pinned_before:
            raise bad_field("release", "the chain is pinned: unpin it (pin: false) to release it")
        return await self.read(chain_id, tenant=tenant)

    async def rewind(self, chain_id: str, data: RewindRequest, *, tenant: str) -> ChainRead:
        await self.state(chain_id, tenant)
        if (data.num_turns is None) == (data.num_tokens is None):
            raise bad_field("num_turns", "give exactly one of num_turns or num_tokens")
        await self._hold(chain_id)
        try:
            chain, turns, regions = await self.rows(chain_id)
            bounds = [0]
            for t in turns:
                bounds.append(bounds[-1] + len(t.appended_token_ids) + len(t.generated_token_ids))
            if data.num_turns is not None:
                if data.num_turns > len(turns):
                    raise bad_field("num_turns", f"the chain has {len(turns)} turns")
                keep = data.num_turns
            elif data.num_tokens in bounds:
                keep = bounds.index(data.num_tokens)
            else:
                raise bad_field("num_tokens", f"must fall on a turn boundary, one of {bounds}")
            boundary = bounds[keep]
            compacted = False
            if keep < len(turns):
                try:
                    await self.worker.call(lambda e: e.rewind_chain(chain_id, boundary), chain=chain_id)
                except UnknownChainError:
                    pass
                info = await self._chain_info(chain_id)
                compacted = info is not None and info.compacted
            else:
                compacted = bool(chain.pruned_intervals)
            kept_regions = [r for r in regions if r.turn < keep]
            pruned_intervals = [[lo, min(hi, boundary)] for lo, hi in chain.pruned_intervals or [] if lo < boundary] \
                if compacted else []
            async with self.db.sessions.begin() as s:
                await self.fence(s, chain_id)
                await s.execute(delete(TurnRow).where(TurnRow.chain_id == chain_id, TurnRow.index >= keep))
                await s.execute(delete(RegionRow).where(RegionRow.chain_id == chain_id, RegionRow.turn >= keep))
                await s.execute(delete(PruneEventRow).where(PruneEventRow.chain_id == chain_id,
                                                            PruneEventRow.after_turn > keep))
                for r in kept_regions:
                    end = min(r.end, boundary)
                    pruned = r.pruned and compacted
                    kept = min(r.kept_tokens, end - r.start) if pruned else end - r.start
                    if (end, pruned, kept) != (r.end, r.pruned, r.kept_tokens):
                        await s.execute(update(RegionRow).where(RegionRow.id == r.id)
                                        .values(end=end, pruned=pruned, kept_tokens=kept))
                await s.execute(update(ChainRow).where(ChainRow.id == chain_id)
                                .values(num_turns=keep, num_tokens=boundary, pruned_intervals=pruned_intervals))
            self.states.pop(chain_id, None)  # rebuilt from the rows on next use
        finally:
            self._let_go(chain_id)
        return await self.read(chain_id, tenant=tenant)

    def _default_method(self) -> tuple[str, dict]:
        engine = self.worker.engine
        return engine.method.name, dict(engine.config.method_config)

    def _chain_method(self, method: str | None, config: dict | None) -> tuple[str, dict]:
        """The (method, config) a new chain runs: the server's unless the request names its own, whose knobs
        are checked here (400 naming the field at fault); the engine takes it on in ``_take_method``."""
        default = self._default_method()
        if method is None and config is None:
            return default
        name = default[0] if method is None else method
        options = dict(config) if config is not None else (default[1] if name == default[0] else {})
        try:
            METHODS.get(name)
        except ConfigError as exc:
            raise bad_field("method", str(exc)) from None
        try:
            create_method(name, options)
        except ConfigError as exc:
            raise bad_field("method_config" if config is not None else "method", str(exc)) from None
        return name, options

    # --- method slots: a configuration other than the server's is retained while chains use it ------
    def _is_default(self, key: MethodKey) -> bool:
        return key == method_key(*self._default_method())

    def _count_method(self, tenant: str, key: MethodKey, delta: int) -> None:
        if self._is_default(key):
            return
        mine = self._tenant_methods.setdefault(tenant, {})
        for counts in (self._method_chains, mine):
            counts[key] = counts.get(key, 0) + delta
            if counts[key] <= 0:
                del counts[key]
        if not mine:
            del self._tenant_methods[tenant]

    async def _take_method(self, tenant: str, key: MethodKey, field: str) -> None:
        """Call holding ``self._creating``, for a new chain of ``tenant`` with ``key``: 429 when it is a new
        configuration for the tenant beyond its limit; the engine takes it on if no chain uses it yet (400
        naming ``field`` when it cannot); then it counts the chain."""
        if self._is_default(key):
            return
        mine = self._tenant_methods.get(tenant, {})
        limit = self.config.max_method_configs_per_tenant
        if key not in mine and limit is not None and len(mine) >= limit:
            raise TooManyMethodConfigs(tenant, limit)
        if key not in self._retained:
            try:
                await self._retain(key)
            except ConfigError as exc:
                raise bad_field(field, str(exc)) from None
        self._count_method(tenant, key, +1)

    async def _give_back_method(self, tenant: str, key: MethodKey) -> None:
        """A chain of ``tenant`` with ``key`` is gone: the engine releases the configuration with its last
        chain (it stays taken on while a request still runs it)."""
        if self._is_default(key):
            return
        self._count_method(tenant, key, -1)
        if key in self._method_chains or key not in self._retained:
            return
        self._retained.discard(key)
        name, config = key[0], msgspec.json.decode(key[1])
        try:
            await self._engine_now(lambda e: e.release_method(name, config))
        except Exception:  # the chain is deleted whatever the engine says
            log.exception("releasing method %s %s failed", name, key[1])

    async def _retain(self, key: MethodKey) -> None:
        """The engine takes ``key`` on and holds it (ConfigError when it cannot)."""
        name, config = key[0], msgspec.json.decode(key[1])
        await self._engine_now(lambda e: e.retain_method(name, config))
        if key in self._retained:  # retained meanwhile by a concurrent request: one hold is enough
            await self._engine_now(lambda e: e.release_method(name, config))
        self._retained.add(key)

    async def _engine_now(self, fn: Callable[[EngineHandle], T]) -> T:
        """``fn(engine)`` on the worker thread, or here when the worker has not started (at ``start``, when
        nothing else touches the engine)."""
        try:
            return await self.worker.call(fn)
        except EngineUnavailable:  # raised only while the worker thread is not running
            return fn(self.worker.engine)

    def _check_scorer(self, name: str, key: str) -> None:
        try:
            SCORERS.get(name)
        except ConfigError as exc:
            raise bad_field(key, str(exc)) from None

    # --- helpers --------------------------------------------------------------------------------
    def _sampling(self, data: TurnCreate, tools: list[dict[str, Any]] | None = None) -> SamplingParams:
        """The turn's engine parameters; ``tools``: the chain's, which ``sampling.tool_choice`` chooses among."""
        s = data.sampling
        max_tokens = s.max_tokens
        if max_tokens > self.config.max_tokens_per_turn:
            if not s.fit_max_tokens:
                raise bad_field("sampling.max_tokens", f"must be <= {self.config.max_tokens_per_turn} (or set "
                                                       "sampling.fit_max_tokens)")
            max_tokens = self.config.max_tokens_per_turn
        vocab = self.worker.engine.model_config.vocab_size
        if len(s.forced_token_ids) > max_tokens:
            raise bad_field("sampling.forced_token_ids", f"has {len(s.forced_token_ids)} tokens, more than "
                                                         f"sampling.max_tokens ({max_tokens})")
        if any(t >= vocab for t in s.forced_token_ids):
            raise bad_field("sampling.forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        structured, _ = structured_spec(s.response_format, s.tool_choice, tools, s.parallel_tool_calls,
                                        prefix="sampling.", tools_key="sampling.tool_choice")
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                              max_tokens=max_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                              ignore_eos=s.ignore_eos, forced_token_ids=list(s.forced_token_ids),
                              structured=structured, fit_max_tokens=s.fit_max_tokens)

    async def write_row(self, state: ChainState, **columns: Any) -> None:
        """Write columns of a chain's row (``meta``, ``system_prompt``, ...) to the database, then to its state; for
        a route that keeps its own data in the chain's metadata (agentrt.conversations)."""
        async with self.db.sessions.begin() as s:
            await s.execute(update(ChainRow).where(ChainRow.id == state.id).values(**columns))
        for name, value in columns.items():
            setattr(state.row, name, value)

    async def rows(self, chain_id: str, tenant: str | None = None) -> tuple[ChainRow, list[TurnRow], list[RegionRow]]:
        """The chain's row, its turns and its regions, in order (ChainNotFound, also for another tenant's)."""
        if "\x00" in chain_id:  # no chain has one (and PostgreSQL cannot even compare it): as any unknown id
            raise ChainNotFound(chain_id)
        async with self.db.sessions() as s:
            chain = await s.get(ChainRow, chain_id)
            if chain is None or (tenant is not None and chain.tenant != tenant):
                raise ChainNotFound(chain_id)
            turns = (await s.scalars(select(TurnRow).where(TurnRow.chain_id == chain_id)
                                     .order_by(TurnRow.index))).all()
            regions = (await s.scalars(select(RegionRow).where(RegionRow.chain_id == chain_id)
                                       .order_by(RegionRow.index))).all()
        return chain, list(turns), list(regions)

    async def _chain_info(self, chain_id: str) -> ChainInfo | None:
        return await self._engine_call(lambda e: e.chain_info(chain_id), chain_id)

    async def _engine_call(self, fn: Callable[[EngineHandle], T], chain: str) -> T | None:
        """``fn(engine)`` on the engine holding ``chain``; None when it does not know the chain."""
        try:
            return await self.worker.call(fn, chain=chain)
        except InvalidRequestError:  # the engine does not know the chain (new, reclaimed or after a restart)
            return None


def _selected(region: Region, data: PruneRequest) -> bool:
    return ((data.regions is None or region.index in data.regions)
            and (data.kinds is None or region.kind in data.kinds)
            and (data.tool_names is None or region.tool_name in data.tool_names)
            and (data.rounds is None or region.round in data.rounds))


def _check_keep(scorer: str | None, keep_ratio: float, keep_tokens: int | None, prefix: str = "") -> None:
    if keep_tokens is not None and keep_ratio:
        raise bad_field(f"{prefix}keep_tokens", "give keep_ratio or keep_tokens, not both")
    if scorer is None and (0.0 < keep_ratio < 1.0 or bool(keep_tokens)):
        raise bad_field(f"{prefix}scorer", "keeping part of a pruned region needs a scorer to choose the kept tokens")


def _region_intervals(regions: list[Region], computed: int, merge: bool) -> list[tuple[int, int]]:
    """The regions' spans that have KV; merged when one prune covers them all (keep_ratio), one per region when
    each keeps its own token count (keep_tokens)."""
    spans = sorted((r.start, min(r.end, computed)) for r in regions if r.start < min(r.end, computed))
    return _merge(spans) if merge else spans


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _clone(row: Any, **changes: Any) -> Any:
    """A new ORM row with ``row``'s column values (but not its surrogate ``id`` unless given) and ``changes``."""
    mapper = inspect(type(row))
    values = {c.key: getattr(row, c.key) for c in mapper.column_attrs if c.key != "id" or "id" in changes}
    values.update(changes)
    return type(row)(**values)
