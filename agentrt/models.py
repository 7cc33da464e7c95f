"""ORM tables: chains, turns (token ids as appended and as generated), regions, prune events, API keys, the
Responses API's responses, and, when engine replicas scale out, chain leases and the replicas' heartbeats."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import JSON, Float, ForeignKey, Integer, LargeBinary, String, Text, TypeDecorator, UniqueConstraint
from sqlalchemy.ext.asyncio import AsyncAttrs
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class TokenIds(TypeDecorator[list[int]]):
    """A list of token ids stored as little-endian uint32 bytes."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: list[int] | None, dialect: Any) -> bytes | None:
        return None if value is None else np.asarray(value, dtype="<u4").tobytes()

    def process_result_value(self, value: bytes | None, dialect: Any) -> list[int] | None:
        return None if value is None else np.frombuffer(value, dtype="<u4").tolist()


NUL_MARK = "\ufdd0"  # a Unicode noncharacter (reserved for a program's internal use): marks an escaped value


def escape_nul(value: str) -> str:
    """``value`` as stored by NulSafeText: unchanged unless it holds NUL or starts with NUL_MARK; then
    NUL_MARK followed by the value with ``%`` written ``%25`` and NUL ``%00``."""
    if "\x00" not in value and not value.startswith(NUL_MARK):
        return value
    return NUL_MARK + value.replace("%", "%25").replace("\x00", "%00")


def unescape_nul(stored: str) -> str:
    if not stored.startswith(NUL_MARK):
        return stored
    return stored[len(NUL_MARK):].replace("%00", "\x00").replace("%25", "%")


class NulSafeText(TypeDecorator[str]):
    """Text that may hold NUL, stored the same way on every dialect: PostgreSQL's ``text`` cannot hold NUL
    ("invalid byte sequence for encoding UTF8: 0x00"), and generated text legitimately can (a byte-level
    tokenizer has a token for the byte 0). Escaped reversibly by ``escape_nul``; a value without NUL that
    does not start with NUL_MARK is stored as it is, so such rows read back the same whoever wrote them."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else escape_nul(value)

    def process_result_value(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else unescape_nul(value)


LOCAL_TENANT = "local"  # the tenant of requests without a key (loopback development without auth)


class Base(AsyncAttrs, DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, list[int]: TokenIds, str: String(255)}


class ChainRow(Base):
    __tablename__ = "chains"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    model: Mapped[str]
    method: Mapped[str]
    method_config: Mapped[dict[str, Any]]
    system_prompt: Mapped[str] = mapped_column(NulSafeText)
    tools: Mapped[list[Any]]
    meta: Mapped[dict[str, Any]]
    num_turns: Mapped[int] = mapped_column(Integer, default=0)
    num_tokens: Mapped[int] = mapped_column(Integer, default=0)
    prune_policy: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=None)
    pruned_intervals: Mapped[list[Any]] = mapped_column(JSON, default=list)  # [[L, R], ...] dropped from the KV now
    parent_id: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    tenant: Mapped[str] = mapped_column(String(128), index=True, default=LOCAL_TENANT,
                                        server_default=LOCAL_TENANT)  # the owner; others get 404


class TurnRow(Base):
    __tablename__ = "turns"
    __table_args__ = (UniqueConstraint("chain_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    chain_id: Mapped[str] = mapped_column(String(64), ForeignKey("chains.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    created_at: Mapped[float] = mapped_column(Float)
    messages: Mapped[list[Any]]
    assistant_prefix: Mapped[str | None] = mapped_column(NulSafeText)
    sampling: Mapped[dict[str, Any]]
    content: Mapped[str] = mapped_column(NulSafeText)  # the assistant prefix and the generated text
    tool_calls: Mapped[list[Any]]
    finish_reason: Mapped[str]
    resume_status: Mapped[str]
    appended_token_ids: Mapped[list[int]]
    generated_token_ids: Mapped[list[int]]
    usage: Mapped[dict[str, Any]]


class RegionRow(Base):
    __tablename__ = "regions"
    __table_args__ = (UniqueConstraint("chain_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    chain_id: Mapped[str] = mapped_column(String(64), ForeignKey("chains.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    start: Mapped[int]
    end: Mapped[int]
    turn: Mapped[int]
    round: Mapped[int | None]
    # unbounded: a tool name may come from generated text, and VARCHAR(255) is enforced by PostgreSQL only
    tool_name: Mapped[str | None] = mapped_column(NulSafeText)
    tool_call_id: Mapped[str | None] = mapped_column(NulSafeText)
    pruned: Mapped[bool] = mapped_column(default=False)
    kept_tokens: Mapped[int]


class PruneEventRow(Base):
    __tablename__ = "prune_events"
    __table_args__ = (UniqueConstraint("chain_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    chain_id: Mapped[str] = mapped_column(String(64), ForeignKey("chains.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    source: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)
    after_turn: Mapped[int]
    intervals: Mapped[list[Any]]
    regions: Mapped[list[Any]]
    scorer: Mapped[str | None]
    keep_ratio: Mapped[float] = mapped_column(Float)
    keep_tokens: Mapped[int | None]
    tokens_kept: Mapped[int]
    tokens_freed: Mapped[int]
    pages_freed: Mapped[int]
    pages_before: Mapped[int]
    pages_after: Mapped[int]


class ResponseRow(Base):
    """A response of the Responses API (agentrt.responses): the chain turn it is, written with the turn (in its
    transaction) and deleted with its chain. ``response`` is the response object as returned (kept also when
    not ``stored``: a later ``previous_response_id`` checks echoed items against its output); ``input_items``
    the request's items as listed by ``input_items`` (empty when not stored)."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))  # the owner; others get 404
    chain_id: Mapped[str] = mapped_column(String(64), ForeignKey("chains.id", ondelete="CASCADE"), index=True)
    turn: Mapped[int]  # the chain turn's index
    stored: Mapped[bool]
    created_at: Mapped[float] = mapped_column(Float)
    response: Mapped[dict[str, Any]]
    input_items: Mapped[list[Any]]


class ApiKeyRow(Base):
    """An API key: ``key_id`` is the public part of the key; only a salted SHA-256 of its secret is stored."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    salt: Mapped[bytes] = mapped_column(LargeBinary)
    key_hash: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    name: Mapped[str | None] = mapped_column(String(255), nullable=True, default=None)


class ChainLeaseRow(Base):
    """Where a chain runs when engine replicas scale out (agentrt.scaleout.leases): ``owner`` is the engine
    replica holding its KV (its turns are routed there), ``holder`` the HTTP replica running one of its turns
    until ``expires_at`` (epoch seconds); ``epoch`` grows with every lease taken, so a holder whose lease
    expired (a partition, a stall) can no longer commit. No foreign key: a lease may outlive its chain by a
    moment (deleted with it, otherwise harmless)."""

    __tablename__ = "chain_leases"

    chain_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True, default=None)
    holder: Mapped[str | None] = mapped_column(String(128), nullable=True, default=None)
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)
    epoch: Mapped[int] = mapped_column(Integer, default=0)


class EngineReplicaRow(Base):
    """An engine replica's heartbeat (agentrt.scaleout.registry): its load for ``/metrics`` with a ``replica``
    label, written every second or so; a replica whose heartbeat is old is gone."""

    __tablename__ = "engine_replicas"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float, index=True)
    stats: Mapped[dict[str, Any]]
