"""responses: the Responses API's responses (a chain turn each), kept across restarts

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

One row per response (agentrt.models.ResponseRow), written in the transaction of the chain turn it is and
deleted with its chain (ON DELETE CASCADE, as the chain's turns): before this revision the map response ->
(chain, turn) lived in the server's memory only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('responses',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('turn', sa.Integer(), nullable=False),
    sa.Column('stored', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('response', sa.JSON(), nullable=False),
    sa.Column('input_items', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['chain_id'], ['chains.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_responses_chain_id'), 'responses', ['chain_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_responses_chain_id'), table_name='responses')
    op.drop_table('responses')
