"""Chain operations beyond create / read / delete: fork a chain (its KV copied in the engine when it can be),
rewind it to a turn boundary, and session hints on its KV (pin, priority, TTL, release, prefetch). Each holds the
chain while it runs."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, inspect, select, update

from agentrt.errors import bad_field
from agentrt.models import ChainRow, PruneEventRow, RegionRow, TurnRow
from agentrt.method_slots import method_key
from engine.chain_index import UnknownChainError
from engine.errors import EngineError
from sdk.schema import ChainRead, ForkRequest, HintsRequest, RewindRequest, TurnHints

if TYPE_CHECKING:
    from agentrt.chains import ChainService
    from engine.engine_handle import EngineHandle

log = logging.getLogger(__name__)


class ChainOps:
    """Fork, rewind and hints on ``chains``' chains (ChainService delegates to it)."""

    def __init__(self, chains: ChainService):
        self.chains = chains

    async def fork(self, chain_id: str, data: ForkRequest, *, tenant: str) -> ChainRead:
        parent = await self.chains.state(chain_id, tenant)
        key = method_key(parent.row.method, parent.row.method_config)
        await self.chains.creating.acquire()
        try:
            await self.chains.check_quota(tenant)
            await self.chains.hold(chain_id)
        except BaseException:
            self.chains.creating.release()
            raise
        new_id = f"chain_{uuid.uuid4().hex}"
        forked = False
        try:
            chain, turns, regions = await self.chains.rows(chain_id)
            try:
                await self.chains.worker.call(lambda e: e.fork_chain(chain_id, new_id), chain=chain_id)
                forked = True
            except (UnknownChainError, EngineError):  # not resident or no room: the fork recomputes its KV
                pass
            try:
                async with self.chains.db.sessions.begin() as s:
                    await self.chains.fence(s, chain_id)
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
                    await self.chains.engine_call(lambda e: e.delete_chain(new_id), chain_id)
                raise
            if forked and self.chains.leases is not None:  # the copy is on its parent's engine replica
                await self.chains.leases.set_owner(new_id, await self.chains.leases.owner(chain_id))
            self.chains.num_chains += 1
            self.chains.methods.count(tenant, key, +1)  # the parent's configuration: already the tenant's, retained
        finally:
            self.chains.creating.release()
            self.chains.let_go(chain_id)
        return await self.chains.read(new_id, tenant=tenant)

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
            await self.chains.worker.call(apply, chain=chain_id)
        except Exception:
            log.exception("session hints of chain %s were not applied", chain_id)

    async def hints(self, chain_id: str, data: HintsRequest, *, tenant: str) -> ChainRead:
        """Session hints on the chain's KV in the engine (``HintsRequest``); a chain the engine does not hold yet
        (never run here, or before its first turn after a restart) takes them with its next turn's KV: the pin and
        priority are applied as soon as the engine knows it."""
        await self.chains.state(chain_id, tenant)
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
            await self.chains.worker.call(apply, chain=chain_id)
        except UnknownChainError:
            pass
        if pinned_before:
            raise bad_field("release", "the chain is pinned: unpin it (pin: false) to release it")
        return await self.chains.read(chain_id, tenant=tenant)

    async def rewind(self, chain_id: str, data: RewindRequest, *, tenant: str) -> ChainRead:
        await self.chains.state(chain_id, tenant)
        if (data.num_turns is None) == (data.num_tokens is None):
            raise bad_field("num_turns", "give exactly one of num_turns or num_tokens")
        await self.chains.hold(chain_id)
        try:
            chain, turns, regions = await self.chains.rows(chain_id)
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
                    await self.chains.worker.call(lambda e: e.rewind_chain(chain_id, boundary), chain=chain_id)
                except UnknownChainError:
                    pass
                info = await self.chains.chain_info(chain_id)
                compacted = info is not None and info.compacted
            else:
                compacted = bool(chain.pruned_intervals)
            kept_regions = [r for r in regions if r.turn < keep]
            pruned_intervals = [[lo, min(hi, boundary)] for lo, hi in chain.pruned_intervals or [] if lo < boundary] \
                if compacted else []
            async with self.chains.db.sessions.begin() as s:
                await self.chains.fence(s, chain_id)
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
            self.chains.states.pop(chain_id, None)  # rebuilt from the rows on next use
        finally:
            self.chains.let_go(chain_id)
        return await self.chains.read(chain_id, tenant=tenant)


def _clone(row: Any, **changes: Any) -> Any:
    """A new ORM row with ``row``'s column values (but not its surrogate ``id`` unless given) and ``changes``."""
    mapper = inspect(type(row))
    values = {c.key: getattr(row, c.key) for c in mapper.column_attrs if c.key != "id" or "id" in changes}
    values.update(changes)
    return type(row)(**values)

