"""Alembic migrations: the migrated schema equals the ORM models (Alembic's own autogenerate comparison finds
no difference), data survive upgrades, and a database made before migrations existed is adopted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Connection, Integer, MetaData, Table, inspect, select, text
from sqlalchemy.ext.asyncio import create_async_engine

from agentrt.db import FIRST_REVISION, alembic_config, current_revision, head_revision, open_database
from agentrt.models import LOCAL_TENANT, Base, ChainRow, TurnRow

TABLES = {"chains", "turns", "regions", "prune_events", "api_keys", "responses", "chain_leases", "engine_replicas"}


def schema_diffs(conn: Connection, metadata: MetaData = Base.metadata) -> list[Any]:
    """What Alembic's autogenerate would change to make the database behind ``conn`` match ``metadata``."""
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    return compare_metadata(context, metadata)


def on_sync(url: str, fn: Callable[[Connection], Any]) -> Any:
    """``fn`` on a sync connection of an async engine for ``url``, in a transaction that commits."""
    async def run() -> Any:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(fn)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def open_and_close(url: str) -> None:
    async def run() -> None:
        await (await open_database(url)).dispose()

    asyncio.run(run())


@pytest.fixture()
def url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"


def test_migrated_schema_equals_the_models(url):
    missing = on_sync(url, schema_diffs)  # an empty database lacks every table and index
    assert {d[1].name for d in missing if d[0] == "add_table"} == TABLES
    assert {d[0] for d in missing} == {"add_table", "add_index"}
    open_and_close(url)
    assert on_sync(url, schema_diffs) == []
    assert set(on_sync(url, lambda c: inspect(c).get_table_names())) == TABLES | {"alembic_version"}
    assert on_sync(url, current_revision) == head_revision()


def test_the_comparison_sees_a_column_the_migrations_lack(url):
    open_and_close(url)
    extended = MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(extended)
    Table("chains", extended, Column("extra", Integer), extend_existing=True)
    diffs = on_sync(url, lambda c: schema_diffs(c, extended))
    assert [(d[0], d[2], d[3].name) for d in diffs] == [("add_column", "chains", "extra")]


def _insert_first_revision_rows(conn: Connection) -> None:
    """Rows written with the first revision's columns (raw SQL: not the ORM of today)."""
    conn.execute(text(
        "INSERT INTO chains (id, created_at, model, method, method_config, system_prompt, tools, meta, num_turns, "
        "num_tokens, pruned_intervals) VALUES ('chain_a', 1.5, 'tiny', 'dense', '{}', 'sys', '[]', '{\"k\": 1}', 1, "
        "5, '[]')"))
    conn.execute(text(
        "INSERT INTO turns (chain_id, \"index\", created_at, messages, sampling, content, tool_calls, finish_reason, "
        "resume_status, appended_token_ids, generated_token_ids, usage) VALUES ('chain_a', 0, 2.0, "
        "'[{\"role\": \"user\", \"content\": \"hi\"}]', '{}', 'ok', '[]', 'stop', 'created', :a, :g, '{}')"),
        {"a": (3).to_bytes(4, "little") + (70000).to_bytes(4, "little") + (1).to_bytes(4, "little"),
         "g": (9).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little")})


async def _read_back(url: str) -> tuple[ChainRow, TurnRow]:
    db = await open_database(url)
    try:
        async with db.sessions() as s:
            chain = await s.get(ChainRow, "chain_a")
            turn = (await s.scalars(select(TurnRow).where(TurnRow.chain_id == "chain_a"))).one()
        return chain, turn
    finally:
        await db.dispose()


def test_upgrading_a_first_revision_database_keeps_its_rows(url):
    on_sync(url, lambda c: command.upgrade(alembic_config(connection=c), FIRST_REVISION))
    assert on_sync(url, current_revision) == FIRST_REVISION
    on_sync(url, _insert_first_revision_rows)
    chain, turn = asyncio.run(_read_back(url))  # open_database upgrades to head first
    assert on_sync(url, current_revision) == head_revision()
    assert (chain.tenant, chain.meta, chain.num_tokens) == (LOCAL_TENANT, {"k": 1}, 5)
    assert turn.appended_token_ids == [3, 70000, 1] and turn.generated_token_ids == [9, 2**32 - 1]
    assert on_sync(url, schema_diffs) == []


def test_a_database_made_before_migrations_is_adopted(url):
    def legacy(conn: Connection) -> None:  # the first slice: create_all, and no tenant column yet
        Base.metadata.create_all(conn)
        conn.execute(text("DROP INDEX ix_chains_tenant"))
        conn.execute(text("ALTER TABLE chains DROP COLUMN tenant"))
        conn.execute(text("ALTER TABLE prune_events DROP COLUMN keep_tokens"))  # added by revision 0002
        conn.execute(text("DROP TABLE responses"))  # added by revision 0004
        conn.execute(text("DROP TABLE chain_leases"))  # added by revision 0005
        conn.execute(text("DROP TABLE engine_replicas"))
        _insert_first_revision_rows(conn)

    on_sync(url, legacy)
    assert "alembic_version" not in on_sync(url, lambda c: inspect(c).get_table_names())
    chain, turn = asyncio.run(_read_back(url))
    assert chain.tenant == LOCAL_TENANT and turn.content == "ok"
    assert on_sync(url, current_revision) == head_revision()
    assert on_sync(url, schema_diffs) == []


def test_downgrade_to_base_and_upgrade_again(url):
    open_and_close(url)
    on_sync(url, lambda c: command.downgrade(alembic_config(connection=c), "base"))
    assert set(on_sync(url, lambda c: inspect(c).get_table_names())) == {"alembic_version"}
    assert on_sync(url, current_revision) is None
    open_and_close(url)
    assert on_sync(url, schema_diffs) == []
