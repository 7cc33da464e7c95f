"""text that may hold NUL: regions' tool names and call ids become unbounded text; NulSafeText columns

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

PostgreSQL's ``text`` cannot hold NUL, so ``agentrt.models.NulSafeText`` (``chains.system_prompt``,
``turns.assistant_prefix``, ``turns.content``, ``regions.tool_name``, ``regions.tool_call_id``) stores a value
that holds NUL, or starts with the mark U+FDD0, as the mark followed by the value with ``%`` written ``%25``
and NUL ``%00``; every other value is stored as it is. Rows written before this revision were stored as they
are, so the few that start with the mark are rewritten in that form here (the schema itself is unchanged for
those columns). ``regions.tool_name`` / ``tool_call_id`` were VARCHAR(255), which PostgreSQL enforces and
SQLite does not: a longer tool name (generated text, or a call id of up to 256 characters) failed only on
PostgreSQL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

MARK = "\ufdd0"
COLUMNS = (("chains", "id", "system_prompt"), ("turns", "id", "assistant_prefix"), ("turns", "id", "content"),
           ("regions", "id", "tool_name"), ("regions", "id", "tool_call_id"))


def _escape(value: str) -> str:
    return MARK + value.replace("%", "%25").replace("\x00", "%00")


def _unescape(stored: str) -> str:
    return stored[len(MARK):].replace("%00", "\x00").replace("%25", "%")


def _rewrite_marked(convert, keep=lambda value: False) -> None:
    """Apply ``convert`` to every value of the NulSafeText columns that starts with the mark (rows are few:
    the mark is a noncharacter); values for which ``keep`` is true are left as they are."""
    if context.is_offline_mode():
        return  # no rows to read: nothing is rewritten in the rendered SQL
    conn = op.get_bind()
    for table, key, column in COLUMNS:
        t = sa.table(table, sa.column(key), sa.column(column, sa.Text()))
        rows = conn.execute(sa.select(t.c[key], t.c[column])
                            .where(sa.func.substr(t.c[column], 1, 1) == MARK)).all()
        for row_id, value in rows:
            if keep(value):
                continue
            conn.execute(sa.update(t).where(t.c[key] == row_id).values({column: convert(value)}))


def _regions(text_type: sa.types.TypeEngine) -> sa.Table | None:
    """The regions table as the revision before leaves it, for SQLite's batch "move and copy" in --sql mode
    (which cannot reflect it); None online, where the table is reflected."""
    if not context.is_offline_mode():
        return None
    return sa.Table(
        'regions', sa.MetaData(),
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('chain_id', sa.String(length=64), nullable=False),
        sa.Column('index', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('start', sa.Integer(), nullable=False),
        sa.Column('end', sa.Integer(), nullable=False),
        sa.Column('turn', sa.Integer(), nullable=False),
        sa.Column('round', sa.Integer(), nullable=True),
        sa.Column('tool_name', text_type, nullable=True),
        sa.Column('tool_call_id', text_type, nullable=True),
        sa.Column('pruned', sa.Boolean(), nullable=False),
        sa.Column('kept_tokens', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['chain_id'], ['chains.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('chain_id', 'index'),
        sa.Index('ix_regions_chain_id', 'chain_id'),
    )


def upgrade() -> None:
    with op.batch_alter_table('regions', copy_from=_regions(sa.String(length=255))) as batch:
        batch.alter_column('tool_name', existing_type=sa.String(length=255), type_=sa.Text(),
                           existing_nullable=True)
        batch.alter_column('tool_call_id', existing_type=sa.String(length=255), type_=sa.Text(),
                           existing_nullable=True)
    _rewrite_marked(_escape)


def downgrade() -> None:
    # values holding NUL stay escaped on PostgreSQL, which cannot store them as they are
    nul_kept = op.get_context().dialect.name == "postgresql"
    _rewrite_marked(_unescape, keep=lambda value: nul_kept and "%00" in value)
    # longer values are cut to the old column's 255 characters
    with op.batch_alter_table('regions', copy_from=_regions(sa.Text())) as batch:
        batch.alter_column('tool_name', existing_type=sa.Text(), type_=sa.String(length=255),
                           existing_nullable=True, postgresql_using='left(tool_name, 255)')
        batch.alter_column('tool_call_id', existing_type=sa.Text(), type_=sa.String(length=255),
                           existing_nullable=True, postgresql_using='left(tool_call_id, 255)')
