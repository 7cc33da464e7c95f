"""Where an idle chain's KV lives, and what moves it: on the device, in the host or disk tier
(``engine.chain_tiers``), or gone (its next turn recomputes it from its tokens).

Pressure (``reclaim``: least recently used idle chains leave the device first, to the host tier when there is
one), session hints (pin, priority, TTL, release now, prefetch now), loading an offloaded chain back before
its turn, fork, rewind or prune (``load``), and restarts (``persist`` at shutdown, ``restore`` at start,
``adopt_file`` for a handed-off chain), and a queued turn's KV moved down under pressure (``park``).
``ChainManager`` owns the chains' semantics and asks this for their KV.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from engine.chain_index import ChainBusyError, ChainIndex, ChainState
from engine.chain_tiers import ChainTiers, OffloadedTable
from engine.contract.cache import CacheManager
from engine.errors import InvalidRequestError
from engine.request import Request
from engine.state_tree import flatten

log = logging.getLogger(__name__)


def idle_state(index: ChainIndex, chain_id: str) -> ChainState:
    """The chain's state; ChainBusyError while a turn of it runs."""
    state = index.get(chain_id)
    if not state.is_idle:
        raise ChainBusyError(f"chain {chain_id!r} has a turn in flight")
    return state


class ChainMemory:
    def __init__(self, index: ChainIndex, cache: CacheManager, tiers: ChainTiers | None = None):
        self.index, self.cache = index, cache
        self.tiers = tiers  # host / disk tiers for idle chains under pressure; None: off
        self._with_ttl: set[str] = set()  # chains with a TTL hint (``expire`` looks at these only)

    # --- pressure and restarts -----------------------------------------------------------------------
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

    def park(self, req: Request) -> bool:
        """Memory is short and ``req``, a queued chain turn that has not run yet, holds its chain's KV: with tiers
        that KV moves down as an idle chain's would (``state.offloaded``) and the turn binds to its chain again
        when it is admitted (``ChainManager.unpark``) instead of recomputing its history. False without tiers or
        chain KV to move (the scheduler then frees what the request holds)."""
        if self.tiers is None or req.chain_id is None or not self.cache.holds(req):
            return False
        state = self.index.get(req.chain_id)
        table = self.cache.detach(req)  # the chain's table as the turn's bind left it (state.num_computed slots)
        entry = self.tiers.offload(state.chain_id, table, _info(state), state.method_state)
        self.cache.release_table(table)
        req.method.release(req)
        req.num_computed_tokens = 0
        state.offloaded, state.num_reclaims = entry, state.num_reclaims + 1
        if entry is None:
            state.num_computed, state.method_state = 0, None
        req.parked = entry is not None
        return True

    def room_for(self, pages: int) -> bool:
        """Whether ``pages`` pages are free, after reclaiming idle chains for them if they are not."""
        if not self.cache.pool.can_allocate(pages):
            self.reclaim(pages)
        return self.cache.pool.can_allocate(pages)

    def drop_offloaded(self, state: ChainState) -> None:
        if state.offloaded is not None:
            self.tiers.drop(state.offloaded)
            state.offloaded = None

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

    def adopt_file(self, path: Path, resolve_method) -> bool:
        """Take over the chain file another engine wrote (``ChainManager.adopt``, after it dropped this engine's
        older copy of the chain): False when the file is gone (another engine claimed it), unreadable, or its
        method is not served here."""
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
    def tier_of(state: ChainState) -> str:
        """Where an idle chain that is not on the device is: ``host`` / ``disk``, or ``reclaimed`` (its KV gone)."""
        entry = state.offloaded
        return entry.where if entry is not None and entry.where in ("host", "disk") else "reclaimed"

    def load(self, state: ChainState, keep: bool = True, turn: bool = False, asynchronous: bool = False) -> bool:
        """Bring an offloaded chain's table back to the device (making room as ``reclaim`` does); True if it is
        resident again. ``keep`` False: the offloaded copy is dropped instead (it cannot serve the turn). ``turn``:
        for a turn, which recomputes a chain on disk instead when that is estimated faster than reading its file
        (``ChainTiers.recompute_instead``); a fork, rewind, prune or prefetch needs the KV itself and loads.
        ``asynchronous``: the pages may still be copying in when this returns (``state.table.ready``,
        ``engine.async_loads``)."""
        if self.tiers is not None:  # what follows changes the table or needs it on the device: no copy stands
            self.tiers.copies.discard(state.chain_id)
        entry, state.offloaded = state.offloaded, None
        if entry is None or self.tiers is None:
            return False
        if turn and keep and self.tiers.recompute_instead(entry, state.num_computed):
            keep = False
        table = self.tiers.load(entry, asynchronous) if keep else None
        if table is None and keep and entry.where != "dropped":
            self.reclaim(entry.num_pages)
            table = self.tiers.load(entry, asynchronous)
        if table is None:
            self.tiers.drop(entry)
            state.num_computed, state.method_state = 0, None
            return False
        state.table = table
        if state.method_state is None:  # a chain adopted from a file: its method state came with its KV
            state.method_state = entry.method_state
        return True

    def copy_down(self, state: ChainState) -> None:
        """A turn of the chain ended: start the host copy a reclaim of it would otherwise make on a step's path."""
        if self.tiers is not None and state.table is not None:
            self.tiers.copy_down(state.chain_id, state.table)

    def forget(self, chain_id: str) -> None:
        """The chain's table is released (deleted, expired): its host copy goes too."""
        if self.tiers is not None:
            self.tiers.copies.discard(chain_id)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step ran ``tokens`` prompt tokens in ``seconds`` (``Scheduler.step_observers``): the prefill rate a
        turn weighs against reading its chain's file from disk."""
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds)

    # --- session hints ------------------------------------------------------------------------------
    def set_pinned(self, chain_id: str, pinned: bool) -> None:
        self.index.get(chain_id).pinned = pinned

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
        state = idle_state(self.index, chain_id)
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
        state = idle_state(self.index, chain_id)
        if state.table is None:
            self.load(state)
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
                self.forget(chain_id)
                self.cache.release_table(state.table)
                state.table = None
            state.num_computed, state.method_state = 0, None
            expired += 1
        return expired


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
