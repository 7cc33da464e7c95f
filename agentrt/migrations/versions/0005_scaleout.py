"""scaleout: chain leases (which engine replica holds a chain, which HTTP replica runs its turn) and the engine
replicas' heartbeats

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

Used only when engine replicas scale out (agentrt.scaleout); a single-process server leaves both tables empty.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('chain_leases',
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=True),
    sa.Column('holder', sa.String(length=128), nullable=True),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('chain_id')
    )
    op.create_table('engine_replicas',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=False),
    sa.Column('stats', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_engine_replicas_heartbeat_at'), 'engine_replicas', ['heartbeat_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_engine_replicas_heartbeat_at'), table_name='engine_replicas')
    op.drop_table('engine_replicas')
    op.drop_table('chain_leases')
