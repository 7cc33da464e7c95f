"""Chains as resources: create, list, read, delete, starting a turn (see agentrt.turns for the rest), and holding a
chain for one operation; prune (agentrt.chain_pruning), fork / rewind / hints (agentrt.chain_ops) and method slots
(agentrt.method_slots) are delegated to their own modules."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from agentrt.chain_ops import ChainOps
from agentrt.chain_pruning import ChainPruner, check_keep, check_scorer
from agentrt.chain_state import ChainState, chain_read, chain_summary, kv_accounting, message_dict, state_from_rows
from agentrt.render_pool import RenderPool
from agentrt.config import ServerConfig
from agentrt.db import Database
from agentrt.engine_worker import EngineWorker
from agentrt.errors import ChainBusy, ChainNotFound, TooManyChains, bad_field
from agentrt.method_slots import MethodKey, MethodSlots, method_key
from agentrt.metrics import Metrics
from agentrt.scaleout.leases import ChainLeases, Lease
from agentrt.models import ChainRow, PruneEventRow, RegionRow, TurnRow
from agentrt.turn_sampling import turn_sampling
from agentrt.turns import PendingTurn
from engine.chain_index import ChainInfo
from engine.errors import ConfigError, InvalidRequestError
from sdk.schema import (ChainCreate, ChainStatus, ChainList, ChainRead, ChainSummary, ForkRequest, HintsRequest,
                        PruneEvent, PruneRequest, PruneResult, RewindRequest, ToolResultMessage, TurnCreate, TurnHints)

if TYPE_CHECKING:
    from engine.engine_handle import EngineHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["ChainService", "MethodKey", "method_key", "no_nul"]


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
        self.creating = asyncio.Lock()  # the per-tenant chain count and the insert that follows it
        self.methods = MethodSlots(config, worker)  # configurations other than the server's, and their chains
        self.pruner = ChainPruner(self)
        self.ops = ChainOps(self)

    async def start(self) -> None:
        """Count the chains, and retain the method configuration of every chain in the database: chains outlive
        the engine, and their slots must not go to other tenants' chains after a restart."""
        async with self.db.sessions() as s:
            self.num_chains = await s.scalar(select(func.count()).select_from(ChainRow)) or 0
            rows = (await s.execute(select(ChainRow.tenant, ChainRow.method, ChainRow.method_config))).all()
        for tenant, method, config in rows:
            self.methods.count(tenant, method_key(method, config), +1)
        for key in list(self.methods.chains):
            try:
                await self.methods.retain(key)
            except ConfigError as exc:  # its chains' turns are 400s naming `method` until it can be retained
                log.warning("method %s %s of existing chains cannot run on this engine: %s", key[0], key[1], exc)

    def counts(self) -> tuple[int, int]:
        return len(self.busy), self.num_chains

    def status(self, chain_id: str) -> ChainStatus:
        return "busy" if chain_id in self.busy else "idle"

    # --- CRUD -----------------------------------------------------------------------------------
    async def check_quota(self, tenant: str) -> None:
        """Call holding ``self.creating``: 429 when the tenant is at its chain limit."""
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
        method, method_config = self.methods.chain_method(data.method, data.method_config)
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
                check_scorer(policy.scorer, "prune_policy.scorer")
            check_keep(policy.scorer, policy.keep_ratio, policy.keep_tokens, "prune_policy.")
        await self.renderer.render([{"role": "system", "content": row.system_prompt}], tools)
        key = method_key(method, method_config)
        async with self.creating:
            await self.check_quota(tenant)
            await self.methods.take(tenant, key, "method_config" if data.method_config is not None else "method")
            try:
                async with self.db.sessions.begin() as s:
                    s.add(row)
            except BaseException:
                await self.methods.give_back(tenant, key)
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
        kv = kv_accounting(chain.num_tokens, await self.chain_info(chain_id))
        return chain_read(chain, self.status(chain_id), turns, regions, kv, include_tokens, list(events))

    async def delete(self, chain_id: str, *, tenant: str) -> None:
        state = await self.state(chain_id, tenant)  # 404 for another tenant's chain before anything else (no 409 leak)
        await self.hold(chain_id)
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
                await self.engine_call(lambda e: e.delete_chain(chain_id), chain_id)
            finally:
                await self.methods.give_back(state.row.tenant, method_key(state.row.method, state.row.method_config))
                if self.leases is not None:
                    await self.leases.forget(chain_id)
        finally:
            self.let_go(chain_id)

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
        await self.hold(chain_id)
        try:
            if self.leases is not None:  # another replica may have run a turn since the read above
                state = await self.state(chain_id, tenant)
            key = method_key(state.row.method, state.row.method_config)
            if key in self.methods.chains and key not in self.methods.retained:
                await self.methods.retain(key)  # not retained at start (the engine could not take it on then)
            renderer = self.renderer.renderer
            params = turn_sampling(data, state.row.tools, self.config.max_tokens_per_turn,
                                   self.worker.engine.model_config.vocab_size, renderer.tool_syntax,
                                   renderer.keeps_special_tokens)
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
                state = await self.pruner.drop_reasoning(state, appended.dropped)
            prompt = state.token_ids + appended.token_ids
            stream = await self.worker.submit(prompt, params, chain_id=chain_id,
                                              method=(state.row.method, state.row.method_config))
        except ConfigError as exc:  # the chain's method cannot run on this server (e.g. restarted otherwise)
            self.let_go(chain_id)
            raise bad_field("method", f"the chain's method {state.row.method!r} cannot run here: {exc}") from None
        except BaseException:
            self.let_go(chain_id)
            raise
        return PendingTurn(self, state, data, messages, appended, prompt, stream)

    def finish_turn(self, chain_id: str, new_state: ChainState | None) -> None:
        if new_state is not None and self.leases is None:
            self.states[chain_id] = new_state
        self.let_go(chain_id)

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

    # --- holding a chain for one operation -------------------------------------------------------
    async def hold(self, chain_id: str) -> None:
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

    def let_go(self, chain_id: str) -> None:
        self.busy.discard(chain_id)
        lease = self._leases.pop(chain_id, None)
        if self.leases is not None and lease is not None:
            task = asyncio.ensure_future(self.leases.release(lease))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    # --- prune / fork / rewind / hints: agentrt.chain_pruning, agentrt.chain_ops ------------------
    async def prune(self, chain_id: str, data: PruneRequest, *, tenant: str) -> PruneResult:
        return await self.pruner.prune(chain_id, data, tenant=tenant)

    async def apply_policy(self, state: ChainState) -> tuple[list[PruneEvent], ChainState]:
        """Right after a turn that appended a tool-result round commits (the chain is still held busy)."""
        return await self.pruner.apply_policy(state)

    async def fork(self, chain_id: str, data: ForkRequest, *, tenant: str) -> ChainRead:
        return await self.ops.fork(chain_id, data, tenant=tenant)

    async def rewind(self, chain_id: str, data: RewindRequest, *, tenant: str) -> ChainRead:
        return await self.ops.rewind(chain_id, data, tenant=tenant)

    async def hints(self, chain_id: str, data: HintsRequest, *, tenant: str) -> ChainRead:
        return await self.ops.hints(chain_id, data, tenant=tenant)

    async def apply_turn_hints(self, chain_id: str, hints: TurnHints) -> None:
        """A turn's hints (``TurnCreate.hints``), once it has ended; a failure is logged, the turn stands."""
        await self.ops.apply_turn_hints(chain_id, hints)

    # --- helpers --------------------------------------------------------------------------------
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

    async def chain_info(self, chain_id: str) -> ChainInfo | None:
        return await self.engine_call(lambda e: e.chain_info(chain_id), chain_id)

    async def engine_call(self, fn: Callable[[EngineHandle], T], chain: str) -> T | None:
        """``fn(engine)`` on the engine holding ``chain``; None when it does not know the chain."""
        try:
            return await self.worker.call(fn, chain=chain)
        except InvalidRequestError:  # the engine does not know the chain (new, reclaimed or after a restart)
            return None


