"""Idle chains below the device: host memory, then disk, instead of recomputing them.

When the scheduler needs pages and reclaims idle chains (``ChainManager.reclaim``), a chain's table is copied to
host memory (pinned on a GPU) before its pages are freed; a full host tier moves its least recently offloaded
chains to disk (one safetensors file per chain under ``chain_disk_dir``), and a full disk tier drops its oldest,
which are then recomputed from their tokens as before. A chain's next turn loads its table back into fresh pages
(``resume_status`` ``loaded``) instead of recomputing.

What moves is representation-blind: the table's pages across every tensor its storage lists
(``KVStorage.page_tensors``: dense K/V, latent rows, a codec's fields), the table's layout (slots, per-layer
lengths and kept positions of a compacted table) and the state a storage keeps with a stopped table (a hybrid
model's recurrent state). This module decides where a chain goes and accounts for it; the file it writes, and
what makes a partial or corrupted one never load (the chain is then recomputed and the reason logged), is
``engine.chain_files``; the record of a table off the device, ``engine.offloaded_table``.

Writes to disk run on a writer thread: a spill moves the entry to the disk tier's accounts at once and keeps its
host tensors until its file is complete, so no engine step waits on a file (a chain loaded meanwhile is served
from those tensors and its file removed when written). Host memory held by writes in flight is bounded by the
host tier's size: a spill beyond it waits for the oldest write. ``flush`` waits for all of them (a shutdown's
``persist``, an adoption).

A turn whose chain is on disk reads its file only when that is not estimated slower than recomputing the chain's
history (``engine.tier_cost``): the tier measures its read rate from its own file loads, the engine its prefill
rate (``observe_prefill``), and a chain whose read is estimated slower by more than the margin is dropped and
recomputed (``recompute_instead``: logged, counted in ``TierCounters.recomputed_by_cost``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
# the writer thread's saver, looked up here at each spill: replacing it here replaces every write's
from safetensors.torch import save_file

from engine.async_loads import SideStreamCopier
from engine.chain_files import (chain_file_name, claim_file, file_bytes, file_chain_id, file_contents, read_file,
                                read_header, remove_partial_files, write_file)
from engine.contract.cache import CacheManager
from engine.host_copies import HostCopies
from engine.offloaded_table import DISK, DROPPED, HOST, OffloadedTable
from engine.page_table import PageTable
from engine.state_tree import flatten, unflatten
from engine.tier_cost import TierRates, read_seconds, recompute_seconds

# names other modules import from here (the chain memory and manager, the scale-out replica)
__all__ = ["DISK", "DROPPED", "HOST", "ChainTiers", "OffloadedTable", "TierCounters", "chain_file_name",
           "file_chain_id"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    """Tokens and seconds moved per tier, and how loads went (exported in ``/metrics`` and chain accounting)."""

    offloaded_tokens: int = 0
    spilled_tokens: int = 0  # host -> disk
    loaded_tokens: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})
    loads: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})
    failed_loads: int = 0
    failed_writes: int = 0  # spills whose file could not be written (the chain is recomputed)
    dropped: int = 0
    # wall seconds of each move: device -> host copies, host -> disk writes (on the writer thread), loads back
    # (with asynchronous loads, starting the copy), and the time turns waited parked for asynchronous copies
    seconds: dict[str, float] = field(default_factory=lambda: {"offload": 0.0, "spill": 0.0, "load_host": 0.0,
                                                               "load_disk": 0.0, "load_wait": 0.0})
    recomputed_by_cost: int = 0  # turns that dropped their chain's file to recompute it (estimated faster)
    # the rates that choice reads (``engine.tier_cost``), 0.0 until measured: reading and checking chain files
    # (bytes per second) and prefill (prompt tokens per second of the steps that ran them)
    disk_read_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    # host copies made at turns' ends, and those a reclaim took instead of copying on the step's path
    copies_made: int = 0
    copies_taken: int = 0


class ChainTiers:
    def __init__(self, cache: CacheManager, host_bytes: int, disk_dir: str | Path | None = None,
                 disk_bytes: int | None = None, host_copies: bool = False):
        self.cache = cache
        self.host_bytes, self.disk_bytes = host_bytes, disk_bytes
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            remove_partial_files(self.disk_dir)
        self.entries: OrderedDict[str, OffloadedTable] = OrderedDict()  # least recently offloaded first
        self.host_used = self.disk_used = 0
        self.counters = TierCounters()
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[OffloadedTable] = []  # in flight, oldest first
        self.rates = TierRates()  # measured: file reads here, prefill by ``observe_prefill``
        self.cost_aware = True  # False: a turn always loads its chain's file (a benchmark timing disk loads)
        # pages copied down at a turn's end, which a reclaim then takes instead of copying on the step's path
        self.copies = HostCopies(cache, enabled=bool(host_copies))
        self._copier = SideStreamCopier()  # loads on a side stream (EngineConfig.chain_async_loads)

    # --- down ---------------------------------------------------------------------------------------
    def copy_down(self, chain_id: str, table: PageTable) -> bool:
        """A chain's turn ended: start the host copy of its pages that a later reclaim takes
        (``engine.host_copies``), where the host tier has room for it beside its chains."""
        self.copies.discard(chain_id)
        made = self.copies.make(chain_id, table, self.host_bytes - self.host_used - self.copies.nbytes)
        self.counters.copies_made += made
        return made

    def offload(self, chain_id: str, table: PageTable, info: dict[str, Any] | None = None,
                method_state: Any = None) -> OffloadedTable | None:
        """Copy ``table`` (about to lose its pages) to the host tier, making room by moving older chains down;
        None when no tier can hold it (it is then recomputed later). ``info``: what a restart needs to adopt the
        chain from its file (JSON-able); ``method_state``: the chain's method state, written into its file."""
        self._reap()
        start = time.perf_counter()
        tensors = self.cache.storage.page_tensors()
        pages = self.copies.take(chain_id, table)  # made at the turn's end, if the table is as it was then
        self.counters.copies_taken += pages is not None
        if pages is None:
            index = torch.tensor(table.pages, dtype=torch.int64, device=tensors[0][0].device)
            pages = [_host(t.index_select(dim, index)) for t, dim in tensors]
        state = [_host(x) for x in _state_tensors(table.state)]
        method_tree, method_tensors, lost = None, [], False
        if method_state is not None:
            try:
                method_tree, method_tensors = flatten(method_state)
                method_tensors = [_host(t) for t in method_tensors]
            except TypeError as exc:
                log.info("chain %s: %s; a restart recomputes it", chain_id, exc)
                method_tree, method_tensors, lost = None, [], True
        nbytes = sum(p.numel() * p.element_size() for p in pages + state + method_tensors)
        self.counters.seconds["offload"] += time.perf_counter() - start
        if not self._room(HOST, nbytes, chain_id):
            return None
        entry = OffloadedTable(chain_id, len(table.pages), table.num_slots,
                               None if table.layer_lens is None else list(table.layer_lens),
                               None if table.kept_positions is None else [k.cpu() for k in table.kept_positions],
                               table.compacted_at, nbytes, pages=pages, state=state,
                               state_type=None if table.state is None else type(table.state), info=info,
                               method_tree=method_tree, method_tensors=method_tensors, method_state_lost=lost)
        self.entries[chain_id] = entry
        self.host_used += nbytes
        self.counters.offloaded_tokens += table.num_slots
        return entry

    def _room(self, tier: str, nbytes: int, chain_id: str) -> bool:
        """Free ``nbytes`` in ``tier`` by moving (host) or dropping (disk) the oldest other entries there."""
        capacity = self.host_bytes if tier == HOST else self.disk_bytes
        if capacity is None or nbytes > capacity:
            return False
        if tier == HOST:  # turn-end copies are speculative: they leave first
            self.copies.make_room(max(0, capacity - self.host_used - nbytes), keep=chain_id)
        for victim in [e for e in self.entries.values() if e.where == tier and e.chain_id != chain_id]:
            if (self.host_used if tier == HOST else self.disk_used) + nbytes <= capacity:
                break
            if tier == HOST and self.disk_dir is not None and self._spill(victim):
                continue
            self.drop(victim)
        return (self.host_used if tier == HOST else self.disk_used) + nbytes <= capacity

    def _spill(self, entry: OffloadedTable, wait: bool = False) -> bool:
        """Host -> disk: one file per chain, written whole under a temporary name, then renamed, on the writer
        thread (``wait``: before returning)."""
        if self.disk_dir is None or not self._room(DISK, entry.nbytes, entry.chain_id):
            return False
        path = self.disk_dir / chain_file_name(entry.chain_id)
        # an earlier write of this chain's file (its copy since loaded or dropped) ends first, so that its
        # removal cannot take this one's file
        while any(w.path == path for w in self._writes) or self._inflight() + entry.nbytes > self.host_bytes:
            if not self._writes:
                break
            self._writes[0].writing.exception()
            self._reap()
        tensors, metadata = file_contents(entry)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chain-tier-writer")
        self.host_used -= entry.nbytes
        self.disk_used += entry.nbytes
        entry.where, entry.path = DISK, path
        entry.writing = self._writer.submit(write_file, path, tensors, metadata, save_file)
        self._writes.append(entry)
        self.counters.spilled_tokens += entry.num_slots
        if wait:
            entry.writing.exception()
            self._reap()
        return True

    def _inflight(self) -> int:
        return sum(w.nbytes for w in self._writes)

    def _reap(self) -> None:
        """Settle the writes that ended: their host tensors go; a cancelled entry's file is removed; a failed
        write drops its entry (recomputed later)."""
        while self._writes and self._writes[0].writing.done():
            entry = self._writes.pop(0)
            future, entry.writing = entry.writing, None
            error = future.exception()
            if error is None:
                self.counters.seconds["spill"] += future.result()
            if entry.cancelled or error is not None:
                entry.path.unlink(missing_ok=True)
            if error is not None and not entry.cancelled:
                log.warning("chain %s: its KV could not be written to disk (%s); it will be recomputed",
                            entry.chain_id, error)
                self.counters.failed_writes += 1
                self.drop(entry)
            entry.pages, entry.state, entry.method_tensors = [], [], []
            if entry.kept_positions is not None:
                entry.kept_positions = []  # read back from the file

    def flush(self) -> None:
        """Wait for every write in flight and settle it."""
        for entry in list(self._writes):
            entry.writing.exception()
        self._reap()

    def drop(self, entry: OffloadedTable) -> None:
        """Forget ``entry`` (its chain is recomputed from its tokens)."""
        if entry.where != DROPPED:
            self.counters.dropped += 1
        self._forget(entry)

    def _forget(self, entry: OffloadedTable) -> None:
        if entry.where == HOST:
            self.host_used -= entry.nbytes
        elif entry.where == DISK:
            self.disk_used -= entry.nbytes
            if entry.writing is not None:
                entry.cancelled = True  # ``_reap`` removes the file once written
            elif entry.path is not None:
                entry.path.unlink(missing_ok=True)
        # a write in flight holds its own references
        entry.where, entry.pages, entry.state, entry.method_tensors = DROPPED, [], [], []
        if self.entries.get(entry.chain_id) is entry:
            del self.entries[entry.chain_id]

    # --- up -----------------------------------------------------------------------------------------
    def load(self, entry: OffloadedTable, asynchronous: bool = False) -> PageTable | None:
        """The entry's table in fresh pages (its bytes copied in), the entry dropped from its tier; None (the
        entry dropped) when it was dropped, its file is unreadable or corrupted, or the pool lacks the pages.
        ``asynchronous`` on a GPU: the pages are copied in on a side stream and the table's ``ready`` holds the
        copy in flight (``engine.async_loads``)."""
        self._reap()
        if entry.where == DROPPED:
            return None
        tier = entry.where
        from_file = tier == DISK and entry.writing is None  # else its host copy, its file not yet written
        start = time.perf_counter()
        try:
            size = file_bytes(entry) if from_file else 0
            pages, state, kept, method_tensors = self._read(entry)
        except (OSError, SafetensorError, ValueError, KeyError) as exc:
            log.warning("chain %s: its offloaded KV could not be read (%s); recomputing it", entry.chain_id, exc)
            self.counters.failed_loads += 1
            self.drop(entry)
            return None
        if from_file:
            self.rates.disk_read.observe(size, time.perf_counter() - start)
            self.counters.disk_read_bytes_per_s = self.rates.disk_read.per_second or 0.0
        pool = self.cache.pool
        if not pool.can_allocate(entry.num_pages):
            return None  # kept where it is: the caller may make room and try again
        new = pool.allocate(entry.num_pages)
        tensors = self.cache.storage.page_tensors()
        ready = None
        if asynchronous and tensors[0][0].device.type == "cuda":
            ready = self._copier.copy_in(tensors, new, pages)
        else:
            index = torch.tensor(new, dtype=torch.int64, device=tensors[0][0].device)
            for (t, dim), data in zip(tensors, pages):
                t.index_copy_(dim, index, data.to(t.device))
        table = PageTable(pages=new, num_slots=entry.num_slots, layer_lens=entry.layer_lens,
                          kept_positions=None if kept is None else [k.to(self.cache.spec.device) for k in kept],
                          compacted_at=entry.compacted_at,
                          state=None if entry.state_type is None else entry.state_type(*state), ready=ready)
        if entry.method_tree is not None:
            entry.method_state = unflatten(entry.method_tree, method_tensors, self.cache.spec.device)
        self.counters.loads[tier] += 1
        self.counters.loaded_tokens[tier] += entry.num_slots
        self.counters.seconds[f"load_{tier}"] += time.perf_counter() - start
        self._forget(entry)
        return table

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that ran ``tokens`` prompt tokens in ``seconds`` (the prefill rate ``recompute_instead`` reads)."""
        self.rates.prefill.observe(tokens, seconds)
        self.counters.prefill_tokens_per_s = self.rates.prefill.per_second or 0.0

    def recompute_instead(self, entry: OffloadedTable, history_tokens: int) -> bool:
        """Whether a turn should drop ``entry`` and recompute its chain's ``history_tokens`` rather than read the
        entry's file (``engine.tier_cost.recompute_instead`` on the measured rates); counted and logged when so.
        Only a written file is weighed: a host copy (or a file still being written, served from its host copy)
        loads."""
        if not self.cost_aware or entry.where != DISK or entry.writing is not None:
            return False
        try:
            size = file_bytes(entry)
        except OSError:
            return False  # the load finds out, and recomputes
        if not self.rates.recompute_instead(size, history_tokens):
            return False
        read_rate, prefill_rate = self.rates.disk_read.per_second, self.rates.prefill.per_second
        log.info("chain %s: recomputing its %d tokens instead of reading its file from disk: reading %d bytes at "
                 "%.3g MB/s is estimated at %.3g s, recomputing at %.3g tokens/s at %.3g s", entry.chain_id,
                 history_tokens, size, read_rate / 1e6, read_seconds(size, read_rate),
                 prefill_rate, recompute_seconds(history_tokens, prefill_rate))
        self.counters.recomputed_by_cost += 1
        return True

    def _read(self, entry: OffloadedTable) -> tuple[list[torch.Tensor], list[torch.Tensor], list | None,
                                                    list[torch.Tensor]]:
        if entry.where == HOST or entry.writing is not None:  # its file is not written yet: the host copy
            return entry.pages, entry.state, entry.kept_positions, entry.method_tensors
        return read_file(entry, len(self.cache.storage.page_tensors()))

    def persist(self, chain_id: str, table: PageTable, info: dict[str, Any],
                method_state: Any = None) -> OffloadedTable | None:
        """Write ``table`` (and the chain's ``method_state``) to the disk tier now (through the host tier), for a
        restart; None if it does not fit."""
        if self.disk_dir is None:
            return None
        entry = self.offload(chain_id, table, info, method_state)
        if entry is not None and not self._spill(entry, wait=True):
            self.drop(entry)
            return None
        return None if entry is None or entry.where == DROPPED else entry

    def persist_entry(self, entry: OffloadedTable) -> bool:
        """An offloaded chain to disk for a restart (a host entry is written now); whether its file stands."""
        if entry.where == HOST:
            if not self._spill(entry, wait=True):
                return False
        elif entry.writing is not None:
            entry.writing.exception()
            self._reap()
        return entry.where == DISK

    def restore(self) -> list[OffloadedTable]:
        """The chains a previous process left in the disk directory, as disk entries (headers read, bytes
        checked when loaded); files without what a restart needs are removed."""
        if self.disk_dir is None:
            return []
        self.flush()
        found = [self._entry(path) for path in sorted(self.disk_dir.glob("*.safetensors"))]
        return [e for e in found if e is not None]

    def adopt(self, path: Path) -> OffloadedTable | None:
        """Take over the chain file another engine wrote (``path``, e.g. a drained replica's handoff): it is moved
        into this tier's directory, which claims it (two engines racing for it: one gets it, the other None). The
        caller drops this tier's own copy of the chain first (``file_chain_id`` names it)."""
        if self.disk_dir is None:
            return None
        self.flush()  # a write of this chain's own file in flight would land over the adopted one
        target = claim_file(path, self.disk_dir)
        return None if target is None else self._entry(target)

    def _entry(self, path: Path) -> OffloadedTable | None:
        """The disk entry of a chain file (header read, bytes checked when loaded); a file without what a
        restart needs, or that does not fit the disk budget, is removed."""
        try:
            header = read_header(path)
        except (OSError, SafetensorError, ValueError, KeyError) as exc:
            log.warning("chain file %s is unreadable (%s): removed", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        lost = header.method_state_lost
        if lost:
            log.info("chain file %s: its method's state could not be written; removed (recomputed when used)",
                     path.name)
        if header.info is None or lost or not self._room(DISK, header.nbytes, header.chain_id):
            path.unlink(missing_ok=True)
            return None
        entry = header.entry(path)
        self.entries[entry.chain_id] = entry
        self.disk_used += entry.nbytes
        return entry

    def where(self, chain_id: str) -> str | None:
        entry = self.entries.get(chain_id)
        return None if entry is None else entry.where


def _host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x)
    return host


def _state_tensors(state: Any) -> list[torch.Tensor]:
    """A storage's per-table state as tensors (a dataclass whose tensor fields come first, e.g. a recurrent
    state; its ``wait()``, if it has one, blocks until copies into them are complete), or none."""
    if state is None:
        return []
    wait = getattr(state, "wait", None)
    if wait is not None:
        wait()
    fields = (getattr(state, name) for name in state.__dataclass_fields__)
    return [x for x in fields if isinstance(x, torch.Tensor)]

