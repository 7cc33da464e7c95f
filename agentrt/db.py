"""The async database: engine and session factory from a URL; the schema is created with create_all (plus the
one column added since the first slice, ``chains.tenant``, added in place to an older database)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from agentrt.models import LOCAL_TENANT, Base


@dataclass(slots=True)
class Database:
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]

    async def dispose(self) -> None:
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def _add_missing_columns(conn: Any) -> None:
    columns = {c["name"] for c in inspect(conn).get_columns("chains")}
    if "tenant" not in columns:
        conn.execute(text(f"ALTER TABLE chains ADD COLUMN tenant VARCHAR(128) NOT NULL DEFAULT '{LOCAL_TENANT}'"))
        conn.execute(text("CREATE INDEX IF NOT EXISTS ix_chains_tenant ON chains (tenant)"))


async def open_database(url: str) -> Database:
    engine = create_async_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.run_sync(_add_missing_columns)
    return Database(engine, async_sessionmaker(engine, expire_on_commit=False))
