"""Chain Cache operations: bind a turn to its chain, retain its KV when it ends, fork, rewind, prune, delete.
Where an idle chain's KV is (device, host, disk) and what moves it is ``engine.chain_memory``'s; pruning is
``engine.chain_prune``'s.

Ownership moves with the turn: while a turn runs, the chain's table belongs to the request (the cache
manager holds it under the request id); when the turn ends it moves back to the chain. A failed or aborted
turn leaves the chain's logical history as it was.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from engine.chain_index import ChainBusyError, ChainIndex, ChainInfo, ChainState, ResumeStatus
from engine.chain_memory import ChainMemory, idle_state
from engine.chain_prune import ChainPruner, PruneResult
from engine.chain_tiers import ChainTiers, file_chain_id
from engine.contract.cache import CacheManager
from engine.contract.scorer import ImportanceScorer
from engine.errors import InvalidRequestError, OutOfPagesError
from engine.request import FinishReason, Request


def _settle(table) -> None:
    """The step's stream waits for the copy into ``table``'s pages (``engine.async_loads``) before it reads them."""
    table.ready.settle()
    table.ready = None


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChainManager:
    def __init__(self, cache: CacheManager, num_layers: int, tiers: ChainTiers | None = None):
        self.index = ChainIndex()
        self.cache = cache
        self.num_layers = num_layers
        self.memory = ChainMemory(self.index, cache, tiers)  # where each idle chain's KV is, and what moves it
        self.async_loads = False  # EngineConfig.chain_async_loads: a turn's load from the host tier on a side stream
        self._loading_since: dict[str, float] = {}  # request id -> when its asynchronous load started
        self.pruner = ChainPruner(cache, num_layers, self.memory.load)

    @property
    def tiers(self) -> ChainTiers | None:
        return self.memory.tiers

    @property
    def prober(self):
        """engine.probe.Prober, for scorers that probe (the pruner's)."""
        return self.pruner.prober

    @prober.setter
    def prober(self, prober) -> None:
        self.pruner.prober = prober

    # --- a turn's life ----------------------------------------------------------------------------
    def check_bindable(self, chain_id: str) -> None:
        if chain_id in self.index and not self.index.get(chain_id).is_idle:
            raise ChainBusyError(f"chain {chain_id!r} already has a turn in flight")

    def bind(self, req: Request, chain_id: str) -> None:
        """Attach the chain's retained KV to ``req`` as far as ``req``'s tokens extend the chain's history."""
        self.check_bindable(chain_id)
        state = self.index.get_or_create(chain_id)
        req.chain_id = chain_id
        if self._wait_for_room(req, state) or self._start_load(req, state):
            return
        self._resume(req, state)

    def _wait_for_room(self, req: Request, state) -> bool:
        """An offloaded chain whose KV has no room on the device now (running turns hold the pages) stays where
        it is and its turn is parked: the scheduler loads it when it admits the turn, instead of it being
        dropped here and recomputed."""
        entry = state.offloaded
        if entry is None or state.method is not req.method or self.memory.room_for(entry.num_pages):
            return False
        req.parked = True
        state.busy_request = req.request_id
        self.index.touch(state)
        return True

    def _start_load(self, req: Request, state) -> bool:
        """With asynchronous loads, an offloaded chain's KV starts copying in on a side stream and its turn waits
        parked until the copy is done (``unpark``), while other requests' steps run (``engine.async_loads``).
        True when the load was made: the turn then waits parked (``req.parked``), or, where the copy is done when
        the load returns (not on a GPU), is bound already."""
        if not self.async_loads or state.offloaded is None or state.method is not req.method:
            return False
        if not self.memory.load(state, turn=True, asynchronous=True):
            return False  # dropped or cheaper to recompute: the turn binds at once and recomputes
        if state.table.ready is None:  # copied in already (not on a GPU)
            req.parked = False
            self._resume(req, state, loaded=True)
            return True
        req.parked = True
        state.busy_request = req.request_id
        self.index.touch(state)
        self._loading_since[req.request_id] = time.perf_counter()
        return True

    def _waited(self, req: Request) -> None:
        """Count how long ``req`` waited parked for its asynchronous load (``TierCounters.seconds["load_wait"]``)."""
        start = self._loading_since.pop(req.request_id, None)
        if start is not None and self.tiers is not None:
            self.tiers.counters.seconds["load_wait"] += time.perf_counter() - start

    def unpark(self, req: Request, must: bool) -> bool:
        """A parked turn (``ChainMemory.park``) is admitted: bind it to its chain again, loading the KV it gave
        up. False, and still parked, when the pool has no room for that KV now, unless ``must`` (nothing else
        runs to free pages): then the turn recomputes. A turn parked while its chain's KV copies in
        (``_start_load``) is admitted once the copy is done, or at once when ``must``, after the step's stream
        is ordered after the copy."""
        state = self.index.get(req.chain_id)
        if state.table is not None and state.table.ready is not None:
            if not must and not state.table.ready.done():
                return False
            _settle(state.table)
            self._waited(req)
            req.parked = False
            self._resume(req, state, loaded=True)
            return True
        entry = state.offloaded
        if entry is not None and not must and not self.memory.room_for(entry.num_pages):
            return False
        if not must and self._start_load(req, state):  # room now: the copy starts, the turn waits for it
            return not req.parked
        req.parked = False
        self._resume(req, state)
        return True

    def _resume(self, req: Request, state, loaded: bool = False) -> None:
        """``loaded``: the chain's KV was loaded back for this turn already (``_start_load``)."""
        resumed = 0
        if state.table is not None and state.method is not req.method:
            self.cache.release_table(state.table)  # retained by another method: its state does not carry over
            state.table, state.num_computed, state.method_state = None, 0, None
        loaded = self.memory.load(state, keep=state.method is req.method, turn=True) or loaded
        if state.table is None:
            status = ResumeStatus.RECOMPUTED if state.token_ids else ResumeStatus.CREATED
        else:
            table, state.table = state.table, None
            common = common_prefix_len(req.token_ids, state.token_ids[: state.num_computed])
            # at most the common prefix, leaving >= 1 token to run for logits; the method may want to compute
            # more of the prompt's end (it is cut back as far towards that as the retained state allows)
            most = min(common, req.num_tokens - 1, state.num_computed)
            want = min(most, req.method.resume_limit(req.num_prompt_tokens))
            usable = self.cache.truncate_logical(table, state.num_computed, want, most) if most > 0 else 0
            if usable > 0:
                self.cache.attach(req, table)
                resumed = usable
                status = ResumeStatus.LOADED if loaded else ResumeStatus.RESUMED
            else:
                self.cache.release_table(table)
                state.method_state = None
                status = ResumeStatus.RECOMPUTED
        state.num_computed = resumed  # what survives if this turn fails
        req.num_computed_tokens = resumed
        if resumed:
            req.method.import_state(req, state.method_state)  # kept on the chain in case the turn aborts
        req.num_cached_tokens = resumed if resumed else -1
        req.num_resumed_tokens = resumed
        req.resume_status = status
        state.busy_request = req.request_id
        self.index.touch(state)

    def on_preempt(self, req: Request) -> None:
        if req.chain_id is not None:
            req.resume_status = ResumeStatus.RECOMPUTED

    def retain(self, req: Request, reason: FinishReason) -> None:
        """The turn ended: give its KV back to the chain (or, on abort, what the chain had before it)."""
        state = self.index.get(req.chain_id)
        if state.table is not None and state.table.ready is not None:  # aborted while its KV copied in
            _settle(state.table)
            self._waited(req)
        exported = None if reason is FinishReason.ABORT or req.parked else req.method.export_state(req)
        table = self.cache.detach(req)
        if reason is FinishReason.ABORT:
            if (table is not None and table.num_slots >= state.num_computed > 0
                    and self.cache.can_truncate(table, state.num_computed)):
                self.cache.truncate_table(table, state.num_computed)
                state.table = table
            elif not req.parked:  # a parked turn's chain keeps the KV the turn gave back (state.offloaded)
                if table is not None:
                    self.cache.release_table(table)
                state.num_computed = 0
        else:
            if table is not None:
                self.cache.release_tail(table)
            state.token_ids = list(req.token_ids)
            state.num_computed = req.num_computed_tokens
            state.table = table
            state.method_state = exported
            state.method = req.method
        if req.parked and reason is not FinishReason.ABORT:
            self.memory.drop_offloaded(state)
        if state.table is None and state.offloaded is None:
            state.num_computed, state.method_state = 0, None
        state.busy_request = None
        state.idle_since = time.monotonic()
        self.index.touch(state)
        self.pruner.apply_deferred(state)
        if reason is not FinishReason.ABORT:
            self.memory.copy_down(state)

    # --- chain operations (idle chains only) ------------------------------------------------------
    def adopt(self, path: Path, resolve_method) -> bool:
        """Take over the chain another engine wrote to ``path`` (a drained replica's handoff), replacing this
        engine's copy of it, which is older (a chain's turns run where its newest state is): the next turn loads
        it. False when the file is gone (another engine claimed it), unreadable, or its method is not served here;
        ChainBusyError when this engine runs a turn of the chain now."""
        chain_id = file_chain_id(path)
        if self.tiers is None or self.tiers.disk_dir is None or chain_id is None:
            return False
        if chain_id in self.index:
            self.delete(chain_id)
        return self.memory.adopt_file(path, resolve_method)

    def delete(self, chain_id: str) -> None:
        state = idle_state(self.index, chain_id)
        if state.offloaded is not None:
            self.tiers.drop(state.offloaded)
        if state.table is not None:
            self.memory.forget(chain_id)
            self.cache.release_table(state.table)
        self.index.pop(chain_id)

    def fork(self, chain_id: str, new_chain_id: str) -> None:
        if new_chain_id in self.index:
            raise InvalidRequestError(f"chain {new_chain_id!r} already exists")
        state = idle_state(self.index, chain_id)
        self.memory.load(state)
        table = None if state.table is None else self.cache.fork_table(state.table)
        if state.table is not None and table is None:
            raise OutOfPagesError(f"not enough free pages to copy chain {chain_id!r}")
        forked = ChainState(new_chain_id, token_ids=list(state.token_ids),
                            num_computed=state.num_computed if table is not None else 0, table=table,
                            method_state=copy.deepcopy(state.method_state), method=state.method)
        self.index.add(forked)
        self.index.touch(forked)

    def rewind(self, chain_id: str, num_tokens: int) -> None:
        """Truncate the chain's history to its first ``num_tokens`` tokens (exact for dense KV; compacted KV and
        a hybrid model's recurrent state, which exists only at the chain's end, are dropped and recomputed on the
        next turn)."""
        state = idle_state(self.index, chain_id)
        if not 0 <= num_tokens <= len(state.token_ids):
            raise InvalidRequestError(f"num_tokens must be in [0, {len(state.token_ids)}], got {num_tokens}")
        state.token_ids = state.token_ids[:num_tokens]
        self.memory.load(state)
        if state.table is not None and num_tokens < state.num_computed:
            if num_tokens == 0 or not self.cache.can_truncate(state.table, num_tokens):
                self.cache.release_table(state.table)
                state.table, state.num_computed, state.method_state = None, 0, None
            else:
                self.cache.truncate_table(state.table, num_tokens)
                state.num_computed = num_tokens

    def prune(
        self, chain_id: str, intervals: list[tuple[int, int]], scorer: ImportanceScorer | None = None,
        keep_ratio: float = 0.0, defer: bool = True, keep_tokens: int | None = None,
    ) -> PruneResult:
        """See ``ChainPruner.prune``."""
        return self.pruner.prune(self.index.get(chain_id), intervals, scorer, keep_ratio, defer, keep_tokens)

    def prune_result(self, prune_id: int) -> PruneResult:
        return self.pruner.prune_result(prune_id)

    def info(self, chain_id: str, busy_request: Request | None = None) -> ChainInfo:
        """Accounting of a chain; pass the running turn's request to see a busy chain's live KV."""
        state = self.index.get(chain_id)
        if busy_request is not None:
            lens = [self.cache.physical_len(busy_request, i) for i in range(self.num_layers)]
            pages, compacted = self.cache.num_pages_held(busy_request), None
        elif state.table is not None:
            lens = [state.table.layer_len(i) for i in range(self.num_layers)]
            pages, compacted = len(state.table.pages), state.table.is_compacted
        else:
            lens, pages, compacted = [0] * self.num_layers, 0, False
        return ChainInfo(
            chain_id=chain_id, logical_tokens=len(state.token_ids), computed_tokens=state.num_computed,
            physical_tokens=lens, pages_held=pages,
            status="busy" if not state.is_idle else "idle" if state.table is not None else self.memory.tier_of(state),
            compacted=bool(compacted), pinned=state.pinned,
        )
