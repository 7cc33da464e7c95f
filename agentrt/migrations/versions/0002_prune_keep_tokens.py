"""prune events record keep_tokens (prunes that keep a token count instead of a ratio)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('prune_events') as batch:
        batch.add_column(sa.Column('keep_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('prune_events') as batch:
        batch.drop_column('keep_tokens')
