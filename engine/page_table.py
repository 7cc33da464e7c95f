"""A request's page table and the arithmetic from slot indices to physical slots.

Slot ``s`` of a table lives in page ``pages[s // page_size]`` at offset ``s % page_size``: physical slot
``pages[s // page_size] * page_size + s % page_size``. Until an eviction method compacts a table, slot ``s``
holds logical position ``s`` in every layer and head; after, each layer has its own length
(``layer_lens``) and each (layer, head) slot its own logical position (``kept_positions`` for the kept slots,
then the tokens appended since, in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.prefix_index import PageKey


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PageTable:
    pages: list[int] = field(default_factory=list)
    keys: list[PageKey] = field(default_factory=list)  # keys of the leading full, published pages
    num_slots: int = 0  # slots in use in the longest layer
    layer_lens: list[int] | None = None  # per-layer slots in use, once compacted
    kept_positions: list[torch.Tensor] | None = None  # per layer [Hkv, n]: logical position of each kept slot
    host_row: np.ndarray | None = None  # int32 copy of ``pages`` for building block tables; None = stale
    compacted_at: int = 0  # logical length at the last compaction; later slots are appended tokens
    window: int | None = None  # the storage's per-table working state (a codec's window), held while running
    state: object | None = None  # what the storage keeps with a stopped table (a recurrent state), if anything
    # a copy into the pages still in flight on a side stream (engine.async_loads.PendingCopy): settle it before
    # anything on the step's stream reads them
    ready: object | None = None

    @property
    def is_compacted(self) -> bool:
        return self.layer_lens is not None

    def is_uniform(self) -> bool:
        return self.layer_lens is None or min(self.layer_lens) == max(self.layer_lens)

    def ordered_from(self, layer: int) -> tuple[int, int]:
        """(slot, position): from that slot to the layer's end the slots hold logical positions position,
        position + 1, ... in order (every head), and every slot before it a position below ``position``: a
        compacted table's kept slots come first (all before its compaction), then what was appended since; a
        table never compacted is in order from slot 0. Known on the host, so a vote can tell its window's slots
        without reading positions off the device."""
        if self.kept_positions is None:
            return 0, 0
        return int(self.kept_positions[layer].shape[1]), self.compacted_at

    def layer_len(self, layer: int) -> int:
        return self.num_slots if self.layer_lens is None else self.layer_lens[layer]

    def pages_row(self) -> np.ndarray:
        if self.host_row is None:
            self.host_row = np.asarray(self.pages, dtype=np.int32)
        return self.host_row

    def pages_tensor(self) -> torch.Tensor:
        """The cached row as an int32 host tensor (shares its memory; treat it as read-only)."""
        return torch.from_numpy(self.pages_row())

    def positions(self, layer: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
        """[num_kv_heads, layer_len(layer)] int64: the logical position each slot of each KV head holds."""
        if self.kept_positions is None:
            return torch.arange(self.num_slots, device=device).expand(num_kv_heads, -1)
        kept = self.kept_positions[layer]
        appended = torch.arange(self.compacted_at, self.compacted_at + self.layer_len(layer) - kept.shape[1],
                                device=device)
        return torch.cat([kept, appended.expand(num_kv_heads, -1)], dim=1)


def kept_positions_of(t: PageTable, keep: list[torch.Tensor], num_kv_heads: int,
                      device: torch.device) -> list[torch.Tensor]:
    """Per layer, the logical positions of a compaction's kept slots (``keep[layer]`` [Hkv, n] slot indices):
    ``t.positions(layer).gather(1, keep[layer])``, in a few launches for all layers where every layer holds as
    many slots, keeps as many and (compacted before) kept as many."""
    uniform = (t.is_uniform and len({k.shape for k in keep}) == 1
               and (t.kept_positions is None or len({k.shape for k in t.kept_positions}) == 1))
    if not uniform:
        return [t.positions(layer, num_kv_heads, device).gather(1, k) for layer, k in enumerate(keep)]
    layers = len(keep)
    if t.kept_positions is None:
        held = torch.arange(t.num_slots, device=device).expand(layers, num_kv_heads, -1)
    else:
        kept = torch.stack(t.kept_positions)
        appended = torch.arange(t.compacted_at, t.compacted_at + t.layer_len(0) - kept.shape[2], device=device)
        held = torch.cat([kept, appended.expand(layers, num_kv_heads, -1)], dim=2)
    return list(held.gather(2, torch.stack(keep)).unbind(0))


def physical_slots(pages: list[int], start: int, n: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Physical slots of slot indices ``start .. start + n - 1`` over ``pages`` ([n] int64 on ``device``), built
    in numpy: a 128K-slot fill or restore calls this once per layer."""
    if n <= 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    ps = page_size
    first = start // ps
    rows = np.asarray(pages[first:(start + n - 1) // ps + 1], dtype=np.int64)
    slots = (rows[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()[start - first * ps:][:n]
    # non-blocking: a blocking copy from pageable memory waits for the GPU's queue to drain first (the source is
    # staged by the driver before the call returns, so it may be freed at once)
    return torch.from_numpy(slots).to(device, non_blocking=True)


def extend_slot_list(pages: list[int], start: int, n: int, page_size: int, out: list[int]) -> None:
    """Append the physical slots of slot indices ``start .. start + n - 1`` to ``out`` (a step's few new slots)."""
    ps = page_size
    pos, end = start, start + n
    while pos < end:
        page, off = divmod(pos, ps)
        take = min(ps - off, end - pos)
        base = pages[page] * ps + off
        out.extend(range(base, base + take))
        pos += take
