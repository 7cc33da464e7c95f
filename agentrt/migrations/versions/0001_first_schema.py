"""the first schema: chains, turns, regions, prune events, API keys

Revision ID: 0001
Revises:
Create Date: 2026-12-01

The tables of agentrt.models as of the first server slice (token ids are LargeBinary: agentrt.models.TokenIds
stores them as little-endian uint32 bytes).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('salt', sa.LargeBinary(), nullable=False),
    sa.Column('key_hash', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.Column('name', sa.String(length=255), nullable=True),
    sa.PrimaryKeyConstraint('key_id')
    )
    op.create_index(op.f('ix_api_keys_tenant'), 'api_keys', ['tenant'], unique=False)
    op.create_table('chains',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('model', sa.String(length=255), nullable=False),
    sa.Column('method', sa.String(length=255), nullable=False),
    sa.Column('method_config', sa.JSON(), nullable=False),
    sa.Column('system_prompt', sa.Text(), nullable=False),
    sa.Column('tools', sa.JSON(), nullable=False),
    sa.Column('meta', sa.JSON(), nullable=False),
    sa.Column('num_turns', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('prune_policy', sa.JSON(), nullable=True),
    sa.Column('pruned_intervals', sa.JSON(), nullable=False),
    sa.Column('parent_id', sa.String(length=64), nullable=True),
    sa.Column('tenant', sa.String(length=128), server_default='local', nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_chains_created_at'), 'chains', ['created_at'], unique=False)
    op.create_index(op.f('ix_chains_tenant'), 'chains', ['tenant'], unique=False)
    op.create_table('prune_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('after_turn', sa.Integer(), nullable=False),
    sa.Column('intervals', sa.JSON(), nullable=False),
    sa.Column('regions', sa.JSON(), nullable=False),
    sa.Column('scorer', sa.String(length=255), nullable=True),
    sa.Column('keep_ratio', sa.Float(), nullable=False),
    sa.Column('tokens_kept', sa.Integer(), nullable=False),
    sa.Column('tokens_freed', sa.Integer(), nullable=False),
    sa.Column('pages_freed', sa.Integer(), nullable=False),
    sa.Column('pages_before', sa.Integer(), nullable=False),
    sa.Column('pages_after', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['chain_id'], ['chains.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('chain_id', 'index')
    )
    op.create_index(op.f('ix_prune_events_chain_id'), 'prune_events', ['chain_id'], unique=False)
    op.create_table('regions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('start', sa.Integer(), nullable=False),
    sa.Column('end', sa.Integer(), nullable=False),
    sa.Column('turn', sa.Integer(), nullable=False),
    sa.Column('round', sa.Integer(), nullable=True),
    sa.Column('tool_name', sa.String(length=255), nullable=True),
    sa.Column('tool_call_id', sa.String(length=255), nullable=True),
    sa.Column('pruned', sa.Boolean(), nullable=False),
    sa.Column('kept_tokens', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['chain_id'], ['chains.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('chain_id', 'index')
    )
    op.create_index(op.f('ix_regions_chain_id'), 'regions', ['chain_id'], unique=False)
    op.create_table('turns',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('messages', sa.JSON(), nullable=False),
    sa.Column('assistant_prefix', sa.Text(), nullable=True),
    sa.Column('sampling', sa.JSON(), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('tool_calls', sa.JSON(), nullable=False),
    sa.Column('finish_reason', sa.String(length=255), nullable=False),
    sa.Column('resume_status', sa.String(length=255), nullable=False),
    sa.Column('appended_token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('generated_token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('usage', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['chain_id'], ['chains.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('chain_id', 'index')
    )
    op.create_index(op.f('ix_turns_chain_id'), 'turns', ['chain_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_turns_chain_id'), table_name='turns')
    op.drop_table('turns')
    op.drop_index(op.f('ix_regions_chain_id'), table_name='regions')
    op.drop_table('regions')
    op.drop_index(op.f('ix_prune_events_chain_id'), table_name='prune_events')
    op.drop_table('prune_events')
    op.drop_index(op.f('ix_chains_tenant'), table_name='chains')
    op.drop_index(op.f('ix_chains_created_at'), table_name='chains')
    op.drop_table('chains')
    op.drop_index(op.f('ix_api_keys_tenant'), table_name='api_keys')
    op.drop_table('api_keys')
