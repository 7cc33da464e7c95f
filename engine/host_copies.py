"""Host copies of idle chains made at their turn's end, so that reclaiming a chain later frees its pages at once.

Under pressure the scheduler reclaims idle chains inside a step: without a copy made earlier, the chain's pages
are copied to host memory there, on the step's path (tens of milliseconds for a long chain's KV). With tiers on a
GPU, a chain's pages are instead copied down when its turn ends, on a side stream into pinned memory, while the
engine goes on; a reclaim then waits for nothing but that copy's event (normally long done) and frees the pages.

A copy is speculative: it takes host memory only where the host tier has room for it beside its chains (it never
moves a chain down to make room, and is discarded first when the tier needs room), and it is used only for the
table it was made from, unchanged: the chain's next turn, a fork / rewind / prune, a delete or a release discards
it, and the table's signature (its pages, slots, per-layer lengths and compaction) must still match when a reclaim
takes it. Copies are made only when asked for (``EngineConfig.chain_host_copies``): on a CPU the device is host
memory and nothing is gained, and on a GPU they are off by default: under an agent replay with memory pressure
they cost the steps more than they save on reclaims (docs/configuration.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.contract.cache import CacheManager
from engine.page_table import PageTable
from engine.side_stream import SideStream, device_index


@dataclass(slots=True)
class HostCopy:
    signature: tuple
    pages: list[torch.Tensor]  # one per storage page tensor, as ``ChainTiers.offload`` would copy them
    nbytes: int
    done: Any  # a CUDA event recorded after the copies (None: made synchronously)


def signature(table: PageTable) -> tuple:
    """What must be unchanged for a copy of ``table`` to stand for it (the table object, its pages, slots,
    per-layer lengths and compaction)."""
    return (id(table), tuple(table.pages), table.num_slots,
            None if table.layer_lens is None else tuple(table.layer_lens), table.compacted_at)


class HostCopies:
    def __init__(self, cache: CacheManager, enabled: bool):
        self.cache = cache
        self.enabled = enabled  # EngineConfig.chain_host_copies
        self.copies: OrderedDict[str, HostCopy] = OrderedDict()  # oldest first
        self.nbytes = 0
        self._side = SideStream()

    def make(self, chain_id: str, table: PageTable, room: int) -> bool:
        """Start copying ``table``'s pages for ``chain_id`` (which has no copy: ``discard`` it first) if ``room``
        host bytes hold it; False when not made."""
        if not self.enabled or not table.pages:
            return False
        tensors = self.cache.storage.page_tensors()
        per_page = sum(t.numel() // t.shape[dim] * t.element_size() for t, dim in tensors)
        nbytes = per_page * len(table.pages)
        if nbytes > room:
            return False
        device = tensors[0][0].device
        done = None
        if device.type == "cuda":  # after the step that wrote the pages, on the side stream

            def copy() -> list[torch.Tensor]:
                index = device_index(table.pages, device)
                pages = []
                for t, dim in tensors:
                    gathered = t.index_select(dim, index)
                    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    host.copy_(gathered, non_blocking=True)
                    pages.append(host)
                return pages

            pages, done = self._side.run(device, copy)
        else:
            index = torch.tensor(table.pages, dtype=torch.int64)
            pages = [t.index_select(dim, index).clone() for t, dim in tensors]
        self.copies[chain_id] = HostCopy(signature(table), pages, nbytes, done)
        self.nbytes += nbytes
        return True

    def take(self, chain_id: str, table: PageTable) -> list[torch.Tensor] | None:
        """The finished copy of ``table``'s pages, if one was made of it as it is now (else None; a stale copy
        is discarded)."""
        copy = self._pop(chain_id)
        if copy is None or copy.signature != signature(table):
            return None
        return copy.pages

    def discard(self, chain_id: str) -> None:
        self._pop(chain_id)

    def make_room(self, nbytes: int, keep: str | None = None) -> None:
        """Discard the oldest copies (other than ``keep``'s) until they hold at most ``nbytes``."""
        for chain_id in [c for c in self.copies if c != keep]:
            if self.nbytes <= nbytes:
                break
            self.discard(chain_id)

    def _pop(self, chain_id: str) -> HostCopy | None:
        copy = self.copies.pop(chain_id, None)
        if copy is not None:
            self.nbytes -= copy.nbytes
            if copy.done is not None:
                copy.done.synchronize()  # its pages may be reused, and its host memory freed, only after it
        return copy
