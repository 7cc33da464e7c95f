"""Chain leases in the database: which engine replica holds a chain, and which HTTP replica may run its turn now.

Several HTTP replicas serve the same chains, so "this chain has a turn in flight" cannot live in one process's
memory. A turn (or a fork, rewind, prune, delete) first takes the chain's lease: one conditional UPDATE that
succeeds only when no other holder's lease is live, and bumps ``epoch``. The holder renews it while the turn runs
(every third of the TTL); the turn's commit releases it in the commit's own transaction, and only if the epoch is
still the holder's (``fence``), so a holder that lost its lease (stalled, partitioned past the TTL) cannot commit
over a newer turn: its commit fails and leaves the chain as the newer holder wrote it.

``owner`` is the engine replica holding the chain's KV: turns are routed to it (agentrt.scaleout.router); a
commit records the replica that ran the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from sqlalchemy import delete, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from agentrt.db import Database
from agentrt.errors import ChainBusy, TurnFailed
from agentrt.models import ChainLeaseRow

log = logging.getLogger(__name__)


class LeaseLost(TurnFailed):
    """The holder's lease expired and another holder took the chain: this turn must not commit."""

    status_code = 409

    def __init__(self, chain_id: str):
        super().__init__(detail=f"chain {chain_id!r}: the turn's lease expired and another request took the chain; "
                                "nothing was written, retry the turn")


@dataclass(slots=True)
class Lease:
    chain_id: str
    epoch: int
    owner: str | None  # the engine replica holding the chain's KV when the lease was taken
    renewal: asyncio.Task | None = field(default=None, repr=False)


class ChainLeases:
    def __init__(self, db: Database, holder: str, ttl_s: float = 30.0):
        self.db = db
        self.holder = holder
        self.ttl_s = ttl_s
        dialect = db.engine.dialect.name
        self._insert = postgresql.insert if dialect == "postgresql" else sqlite.insert

    async def acquire(self, chain_id: str) -> Lease:
        """Take the chain's lease (ChainBusy when another holder's is live) and keep it renewed until
        ``release``. A live lease of this same holder is taken over: the holder's process holds a chain once at a
        time (ChainService.busy), so such a lease is one whose release has not landed yet (a failed turn retried
        at once); its epoch is then stale, and its release and fence no-ops."""
        now = time.time()
        async with self.db.sessions.begin() as s:
            await s.execute(self._insert(ChainLeaseRow).values(chain_id=chain_id, expires_at=0.0, epoch=0)
                            .on_conflict_do_nothing(index_elements=["chain_id"]))
            row = (await s.execute(
                update(ChainLeaseRow)
                .where(ChainLeaseRow.chain_id == chain_id,
                       or_(ChainLeaseRow.holder.is_(None), ChainLeaseRow.holder == self.holder,
                           ChainLeaseRow.expires_at < now))
                .values(holder=self.holder, expires_at=now + self.ttl_s, epoch=ChainLeaseRow.epoch + 1)
                .returning(ChainLeaseRow.epoch, ChainLeaseRow.owner))).first()
        if row is None:
            raise ChainBusy(chain_id)
        lease = Lease(chain_id, row.epoch, row.owner)
        lease.renewal = asyncio.ensure_future(self._renew(lease))
        return lease

    async def _renew(self, lease: Lease) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                async with self.db.sessions.begin() as s:
                    held = (await s.execute(self._held(lease).values(expires_at=time.time() + self.ttl_s))).rowcount
            except Exception:  # noqa: BLE001 -- a database hiccup: the next renewal may succeed; the fence decides
                log.exception("renewing the lease of %s failed", lease.chain_id)
                continue
            if not held:
                log.warning("chain %s: lease lost (epoch %d)", lease.chain_id, lease.epoch)
                return

    def _held(self, lease: Lease):
        return update(ChainLeaseRow).where(ChainLeaseRow.chain_id == lease.chain_id,
                                           ChainLeaseRow.holder == self.holder, ChainLeaseRow.epoch == lease.epoch)

    async def fence(self, session: AsyncSession, lease: Lease, owner: str | None, release: bool = True) -> None:
        """In a transaction writing the lease's work: raise LeaseLost (the transaction rolls back) when the lease is
        no longer the holder's; else record ``owner`` (None: keep it) and, with ``release``, give the lease back
        in the same transaction (without: the holder keeps it for more work, e.g. a pruning policy after a
        turn)."""
        values = ({"holder": None, "expires_at": 0.0} if release else {"expires_at": time.time() + self.ttl_s}) \
            | ({} if owner is None else {"owner": owner})
        if not (await session.execute(self._held(lease).values(**values))).rowcount:
            raise LeaseLost(lease.chain_id)
        if release:
            self._stop(lease)

    async def release(self, lease: Lease, owner: str | None = None) -> None:
        """Give the lease back (work that failed, or needs no fence); ``owner``: record it (None: keep)."""
        self._stop(lease)
        values = {"holder": None, "expires_at": 0.0} | ({} if owner is None else {"owner": owner})
        async with self.db.sessions.begin() as s:
            await s.execute(self._held(lease).values(**values))

    @staticmethod
    def _stop(lease: Lease) -> None:
        if lease.renewal is not None:
            lease.renewal.cancel()
            lease.renewal = None

    async def owner(self, chain_id: str) -> str | None:
        async with self.db.sessions() as s:
            return await s.scalar(select(ChainLeaseRow.owner).where(ChainLeaseRow.chain_id == chain_id))

    async def set_owner(self, chain_id: str, owner: str | None) -> None:
        """Record where a chain is without a lease (a fork's new chain: on its parent's replica)."""
        async with self.db.sessions.begin() as s:
            await s.execute(self._insert(ChainLeaseRow).values(chain_id=chain_id, expires_at=0.0, epoch=0)
                            .on_conflict_do_nothing(index_elements=["chain_id"]))
            await s.execute(update(ChainLeaseRow).where(ChainLeaseRow.chain_id == chain_id).values(owner=owner))

    async def forget(self, chain_id: str) -> None:
        with contextlib.suppress(Exception):
            async with self.db.sessions.begin() as s:
                await s.execute(delete(ChainLeaseRow).where(ChainLeaseRow.chain_id == chain_id))
