"""The async database: engine and session factory from a URL; the schema is brought to the newest Alembic
revision (agentrt/migrations) when it is opened.

A database made before migrations existed (by ``create_all``: tables but no ``alembic_version``) is adopted:
the one column added since the first slice (``chains.tenant``) is added when missing, then it is stamped with
the first revision, which creates exactly those tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, event, inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from agentrt.models import LOCAL_TENANT

MIGRATIONS = Path(__file__).with_name("migrations")
FIRST_REVISION = "0001"


@dataclass(slots=True)
class Database:
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]

    async def dispose(self) -> None:
        await self.engine.dispose()


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    """An Alembic config without alembic.ini: for ``alembic.command.*`` on ``connection`` (or on ``url``)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _adopt_unversioned(conn: Connection) -> None:
    tables = set(inspect(conn).get_table_names())
    if "chains" not in tables or "alembic_version" in tables:
        return
    if "tenant" not in {c["name"] for c in inspect(conn).get_columns("chains")}:
        conn.execute(text(f"ALTER TABLE chains ADD COLUMN tenant VARCHAR(128) NOT NULL DEFAULT '{LOCAL_TENANT}'"))
        conn.execute(text("CREATE INDEX ix_chains_tenant ON chains (tenant)"))
    command.stamp(alembic_config(connection=conn), FIRST_REVISION)


def upgrade(conn: Connection, revision: str = "head") -> None:
    """Migrate the database behind ``conn`` (a sync connection, e.g. under ``AsyncConnection.run_sync``)."""
    _adopt_unversioned(conn)
    command.upgrade(alembic_config(connection=conn), revision)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()
    dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own: ``_begin_immediate`` does


def _begin_immediate(conn: Connection) -> None:
    """Every transaction takes SQLite's write lock when it begins: a deferred one that read and then writes
    while another connection has written meanwhile fails at once ("database is locked", no busy wait: WAL cannot
    upgrade its stale snapshot), which replicas writing one file (chain leases read, then write) hit under load;
    at BEGIN IMMEDIATE a writer waits up to the busy timeout instead."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


SQLITE_BUSY_TIMEOUT_S = 30.0


async def open_database(url: str) -> Database:
    """SQLite waits up to SQLITE_BUSY_TIMEOUT_S for another connection's write to end (sqlite3's default is 5 s):
    with replicas (agentrt.scaleout) several processes write one file, and a writer on a loaded machine can hold
    the lock for seconds; a request failing there would be a 500 where a wait serves it."""
    is_sqlite = url.startswith("sqlite")
    engine = create_async_engine(url, **({"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}} if is_sqlite else {}))
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        event.listen(engine.sync_engine, "begin", _begin_immediate)
    async with engine.begin() as conn:
        await conn.run_sync(upgrade)
    return Database(engine, async_sessionmaker(engine, expire_on_commit=False))
