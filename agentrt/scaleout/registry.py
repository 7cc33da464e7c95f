"""The engine replicas' heartbeats in the database: each replica writes its load every second or so; any HTTP
replica reads them for ``/metrics`` (one series per replica, labelled ``replica``)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from agentrt.db import Database
from agentrt.models import EngineReplicaRow

STALE_S = 5.0  # a replica whose heartbeat is older is gone (killed, partitioned)


async def beat(db: Database, replica_id: str, started_at: float, stats: dict[str, Any]) -> None:
    insert = postgresql.insert if db.engine.dialect.name == "postgresql" else sqlite.insert
    now = time.time()
    async with db.sessions.begin() as s:
        await s.execute(insert(EngineReplicaRow).values(id=replica_id, started_at=started_at, heartbeat_at=now,
                                                        stats=stats)
                        .on_conflict_do_nothing(index_elements=["id"]))
        await s.execute(update(EngineReplicaRow).where(EngineReplicaRow.id == replica_id)
                        .values(heartbeat_at=now, stats=stats))


async def leave(db: Database, replica_id: str) -> None:
    async with db.sessions.begin() as s:
        await s.execute(delete(EngineReplicaRow).where(EngineReplicaRow.id == replica_id))


async def live(db: Database, stale_s: float = STALE_S) -> dict[str, dict[str, Any]]:
    """The replicas heard from within ``stale_s`` seconds: id -> stats."""
    async with db.sessions() as s:
        rows = (await s.execute(select(EngineReplicaRow.id, EngineReplicaRow.stats)
                                .where(EngineReplicaRow.heartbeat_at >= time.time() - stale_s))).all()
    return {row.id: row.stats for row in rows}
