"""Chain index: conversations whose KV outlives each turn.

``chain_id -> ChainState``: the logical token history, the retained page table (possibly compacted by the
method), the method's exported state, last use and pin. A turn's request that extends the history re-attaches
the table and prefills only the new suffix; idle chains are reclaimed least-recently-used when memory runs
short (their next turn is recomputed from the logical tokens, never refused).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.paged_cache import PageTable


class ResumeStatus(str, enum.Enum):
    CREATED = "created"  # the chain's first turn
    RESUMED = "resumed"  # the retained KV was re-attached; only the suffix is prefilled
    RECOMPUTED = "recomputed"  # the retained KV was gone (reclaimed) or unusable (diverged after compaction)
    LOADED = "loaded"  # the retained KV was moved to host memory or disk under pressure and loaded back


class ChainBusyError(InvalidRequestError):
    """A chain already has a turn in flight."""


class UnknownChainError(InvalidRequestError):
    """No chain by that id."""


@dataclass(slots=True)
class ChainState:
    chain_id: str
    token_ids: list[int] = field(default_factory=list)  # logical history: every token of every turn
    num_computed: int = 0  # leading tokens of the history whose KV the table holds
    table: PageTable | None = None
    method_state: Any = None
    method: Any = None  # the SparseMethod whose state the table holds (a resumed turn must use the same)
    last_used: int = 0
    pinned: bool = False
    busy_request: str | None = None
    num_reclaims: int = 0
    pruned_intervals: list[tuple[int, int]] = field(default_factory=list)
    offloaded: Any = None  # engine.chain_tiers.OffloadedTable: the table moved below the device, if any
    priority: int = 0  # session hint: under pressure lower priorities leave the device first
    ttl_s: float | None = None  # session hint: an idle chain's KV is dropped after this many seconds idle
    idle_since: float = 0.0  # time.monotonic() when its last turn ended

    @property
    def is_idle(self) -> bool:
        return self.busy_request is None

    @property
    def is_resident(self) -> bool:
        return self.table is not None


@dataclass(slots=True, frozen=True)
class ChainInfo:
    chain_id: str
    logical_tokens: int
    computed_tokens: int
    physical_tokens: list[int]  # per layer
    pages_held: int
    status: str  # busy | idle | host | disk (offloaded, loaded back by the next turn) | reclaimed
    compacted: bool
    pinned: bool


class ChainIndex:
    def __init__(self) -> None:
        self._chains: dict[str, ChainState] = {}
        self._clock = itertools.count(1)

    def __contains__(self, chain_id: str) -> bool:
        return chain_id in self._chains

    def __len__(self) -> int:
        return len(self._chains)

    def get(self, chain_id: str) -> ChainState:
        state = self._chains.get(chain_id)
        if state is None:
            raise UnknownChainError(f"unknown chain_id {chain_id!r}")
        return state

    def get_or_create(self, chain_id: str) -> ChainState:
        if chain_id not in self._chains:
            self._chains[chain_id] = ChainState(chain_id)
        return self._chains[chain_id]

    def add(self, state: ChainState) -> None:
        assert state.chain_id not in self._chains
        self._chains[state.chain_id] = state

    def pop(self, chain_id: str) -> ChainState:
        self.get(chain_id)
        return self._chains.pop(chain_id)

    def touch(self, state: ChainState) -> None:
        state.last_used = next(self._clock)

    def reclaim_order(self) -> list[ChainState]:
        """Idle, unpinned chains that hold KV: lowest priority, then least recently used first."""
        idle = [c for c in self._chains.values() if c.is_idle and c.is_resident and not c.pinned]
        return sorted(idle, key=lambda c: (c.priority, c.last_used))

    def states(self) -> list[ChainState]:
        return list(self._chains.values())
