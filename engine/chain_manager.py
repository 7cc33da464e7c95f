"""Chain Cache operations: bind a turn to its chain, retain its KV when it ends, reclaim, fork, rewind.

Ownership moves with the turn: while a turn runs, the chain's table belongs to the request (the cache
manager holds it under the request id); when the turn ends it moves back to the chain. A failed or aborted
turn leaves the chain's logical history as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path

from engine.chain_index import ChainBusyError, ChainIndex, ChainInfo, ChainState, ResumeStatus
from engine.chain_prune import ChainPruner, PruneResult
from engine.chain_tiers import ChainTiers, OffloadedTable, file_chain_id
from engine.contract.cache import CacheManager
from engine.contract.scorer import ImportanceScorer
from engine.errors import InvalidRequestError, OutOfPagesError
from engine.request import FinishReason, Request
from engine.state_tree import flatten

log = logging.getLogger(__name__)


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
        self.tiers = tiers  # host / disk tiers for idle chains under pressure (engine.chain_tiers); None: off
        self._with_ttl: set[str] = set()  # chains with a TTL hint (``expire`` looks at these only)
        self.pruner = ChainPruner(cache, num_layers, self._load)

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
        resumed = 0
        if state.table is not None and state.method is not req.method:
            self.cache.release_table(state.table)  # retained by another method: its state does not carry over
            state.table, state.num_computed, state.method_state = None, 0, None
        loaded = self._load(state, keep=state.method is req.method)
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
        exported = None if reason is FinishReason.ABORT else req.method.export_state(req)
        table = self.cache.detach(req)
        if reason is FinishReason.ABORT:
            if (table is not None and table.num_slots >= state.num_computed > 0
                    and self.cache.can_truncate(table, state.num_computed)):
                self.cache.truncate_table(table, state.num_computed)
                state.table = table
            else:
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
        if state.table is None:
            state.num_computed, state.method_state = 0, None
        state.busy_request = None
        state.idle_since = time.monotonic()
        self.index.touch(state)
        self.pruner.apply_deferred(state)

    # --- memory -----------------------------------------------------------------------------------
    def reclaim(self, pages_needed: int) -> bool:
        """Free idle chains' KV, least recently used first, until ``pages_needed`` pages are free. With tiers a
        chain's table moves to host memory (or further down) first, and its next turn loads it back."""
        freed = False
        for state in self.index.reclaim_order():
            if self.cache.pool.can_allocate(pages_needed):
                break
            entry = None if self.tiers is None else self.tiers.offload(state.chain_id, state.table, _info(state),
                                                                       state.method_state)
            self.cache.release_table(state.table)
            state.table, state.offloaded = None, entry
            if entry is None:
                state.num_computed, state.method_state = 0, None
            state.num_reclaims += 1
            freed = True
        return freed

    def persist(self) -> int:
        """Write every idle chain's table to the disk tier (a server shutting down), so that the next process
        adopts them (``restore``) and their next turns load instead of recomputing; returns how many were
        written. Pinned chains are written too, and so are chains in the host tier; chains on disk already are
        counted once their files are complete. A chain's method state is written into its file (a method whose
        state is not tensors, lists, dicts and scalars cannot be: such chains are not written)."""
        if self.tiers is None:
            return 0
        written = 0
        for state in self.index.states():
            if not state.is_idle or not _writable(state.method_state):
                continue
            if state.table is not None:
                entry = self.tiers.persist(state.chain_id, state.table, _info(state), state.method_state)
                if entry is not None:
                    self.cache.release_table(state.table)
                    state.table, state.offloaded = None, entry
                    written += 1
            elif state.offloaded is not None:
                written += self.tiers.persist_entry(state.offloaded)
        self.tiers.flush()
        return written

    def restore(self, resolve_method) -> int:
        """Adopt the chains a previous process wrote to the disk tier: their tokens and method come from the
        file, their KV stays on disk until their next turn loads it. ``resolve_method(name, options)`` gives the
        engine's instance; a chain whose method it cannot serve is dropped (recomputed when it is next used)."""
        adopted = 0
        for entry in [] if self.tiers is None else self.tiers.restore():
            if entry.chain_id in self.index:
                self.tiers.drop(entry)
                continue
            adopted += self._adopt_entry(entry, resolve_method)
        return adopted

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
        entry = self.tiers.adopt(path)
        return entry is not None and self._adopt_entry(entry, resolve_method)

    def _adopt_entry(self, entry: OffloadedTable, resolve_method) -> bool:
        info = entry.info
        try:
            method = resolve_method(info["method"], info["method_config"])
        except Exception as exc:  # noqa: BLE001 -- a method this engine cannot take on
            log.warning("chain %s from disk: method %r not served here (%s); dropped", entry.chain_id,
                        info.get("method"), exc)
            self.tiers.drop(entry)
            return False
        state = ChainState(entry.chain_id, token_ids=list(info["token_ids"]), num_computed=info["num_computed"],
                           method=method, offloaded=entry)
        self.index.add(state)
        self.index.touch(state)
        return True

    @staticmethod
    def _tier_of(state: ChainState) -> str:
        """Where an idle chain that is not on the device is: ``host`` / ``disk``, or ``reclaimed`` (its KV gone)."""
        entry = state.offloaded
        return entry.where if entry is not None and entry.where in ("host", "disk") else "reclaimed"

    def _load(self, state: ChainState, keep: bool = True) -> bool:
        """Bring an offloaded chain's table back to the device (making room as ``reclaim`` does); True if it is
        resident again. ``keep`` False: the offloaded copy is dropped instead (it cannot serve the turn)."""
        entry, state.offloaded = state.offloaded, None
        if entry is None or self.tiers is None:
            return False
        table = self.tiers.load(entry) if keep else None
        if table is None and keep and entry.where != "dropped":
            self.reclaim(entry.num_pages)
            table = self.tiers.load(entry)
        if table is None:
            self.tiers.drop(entry)
            state.num_computed, state.method_state = 0, None
            return False
        state.table = table
        if state.method_state is None:  # a chain adopted from a file: its method state came with its KV
            state.method_state = entry.method_state
        return True

    # --- chain operations (idle chains only) ------------------------------------------------------
    def _idle(self, chain_id: str) -> ChainState:
        state = self.index.get(chain_id)
        if not state.is_idle:
            raise ChainBusyError(f"chain {chain_id!r} has a turn in flight")
        return state

    def delete(self, chain_id: str) -> None:
        state = self._idle(chain_id)
        if state.offloaded is not None:
            self.tiers.drop(state.offloaded)
        if state.table is not None:
            self.cache.release_table(state.table)
        self.index.pop(chain_id)

    def fork(self, chain_id: str, new_chain_id: str) -> None:
        if new_chain_id in self.index:
            raise InvalidRequestError(f"chain {new_chain_id!r} already exists")
        state = self._idle(chain_id)
        self._load(state)
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
        state = self._idle(chain_id)
        if not 0 <= num_tokens <= len(state.token_ids):
            raise InvalidRequestError(f"num_tokens must be in [0, {len(state.token_ids)}], got {num_tokens}")
        state.token_ids = state.token_ids[:num_tokens]
        self._load(state)
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

    def set_pinned(self, chain_id: str, pinned: bool) -> None:
        self.index.get(chain_id).pinned = pinned

    # --- session hints ------------------------------------------------------------------------------
    def set_hints(self, chain_id: str, *, priority: int | None = None, ttl_s: float | None = None,
                  clear_ttl: bool = False) -> None:
        """Retention hints: ``priority`` (under pressure lower priorities leave the device first; default 0) and
        ``ttl_s`` (an idle chain's KV is dropped after that many seconds idle; ``clear_ttl``: no expiry)."""
        state = self.index.get(chain_id)
        if priority is not None:
            state.priority = priority
        if ttl_s is not None:
            if not ttl_s > 0:
                raise InvalidRequestError(f"ttl_s must be > 0, got {ttl_s!r}")
            state.ttl_s = ttl_s
            self._with_ttl.add(chain_id)
        if clear_ttl:
            state.ttl_s = None
            self._with_ttl.discard(chain_id)

    def release(self, chain_id: str) -> bool:
        """Take an idle chain's KV off the device now (to the host tier when there is one, else dropped: its
        next turn recomputes); False if it held none. A pinned chain is never moved."""
        state = self._idle(chain_id)
        if state.table is None:
            return False
        if state.pinned:
            raise InvalidRequestError(f"chain {chain_id!r} is pinned: unpin it before releasing it")
        entry = None if self.tiers is None else self.tiers.offload(chain_id, state.table, _info(state),
                                                                   state.method_state)
        self.cache.release_table(state.table)
        state.table, state.offloaded = None, entry
        if entry is None:
            state.num_computed, state.method_state = 0, None
        return True

    def prefetch(self, chain_id: str) -> bool:
        """Load an idle chain's offloaded KV back to the device now (an agent about to send a tool result warms
        its chain); True if it is resident afterwards."""
        state = self._idle(chain_id)
        if state.table is None:
            self._load(state)
        return state.table is not None

    def expire(self, now: float) -> int:
        """Drop the KV of idle chains past their TTL (device and tiers); returns how many."""
        expired = 0
        for chain_id in list(self._with_ttl):
            if chain_id not in self.index:
                self._with_ttl.discard(chain_id)
                continue
            state = self.index.get(chain_id)
            if state.ttl_s is None or not state.is_idle or now - state.idle_since < state.ttl_s:
                continue
            if state.table is None and state.offloaded is None:
                continue
            if state.offloaded is not None:
                self.tiers.drop(state.offloaded)
                state.offloaded = None
            if state.table is not None:
                self.cache.release_table(state.table)
                state.table = None
            state.num_computed, state.method_state = 0, None
            expired += 1
        return expired

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
            status="busy" if not state.is_idle else ("idle" if state.table is not None else self._tier_of(state)),
            compacted=bool(compacted), pinned=state.pinned,
        )


def _writable(method_state) -> bool:
    """Whether a chain file can hold the method state (``engine.state_tree``)."""
    try:
        flatten(method_state)
    except TypeError:
        return False
    return True


def _info(state: ChainState) -> dict:
    """What a restart needs to adopt a chain from its file: its tokens and its method (name and knobs)."""
    config = state.method.config
    options = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
    return {"token_ids": list(state.token_ids), "num_computed": state.num_computed,
            "method": state.method.name, "method_config": options}
