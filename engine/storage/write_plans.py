"""Where a step's new rows go under a codec with a full-precision window (``engine.storage.coded``).

A codec encodes tokens in groups; a running request's open group and its most recent rows also sit in its
window (a ring). Each step re-encodes the groups its new rows touch, taking earlier rows of a group from the
ring and new ones from the step, and copies the rows the window keeps into the ring. ``plan_rows`` builds that
on the host for a step's requests (numpy, every request at once); ``plan_decode`` builds it on the device with
fixed shapes for a pure-decode step (a decode CUDA graph captures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.storage.coded import CodedStorage


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``starts[i] .. starts[i] + counts[i] - 1`` (int64)."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - offsets + np.repeat(starts, counts)



@dataclass(slots=True)
class WritePlan:
    """How one step's new rows land for a codec with a window (shared by layers of equal lengths).

    Every slot of the groups (re-)encoded this step, group by group, comes from the ring (``from_ring``:
    flat ring index ``ring_src``) or from the step's new rows (row ``row_src``); group_slots: [M] their
    physical slots. ring_dst / ring_rows: new rows copied into the ring (flat ring index, row)."""

    from_ring: torch.Tensor
    ring_src: torch.Tensor
    row_src: torch.Tensor
    group_slots: torch.Tensor
    ring_dst: torch.Tensor
    ring_rows: torch.Tensor


def plan_rows(storage: CodedStorage, items: list[tuple[int, int, int, int]], pages: list[list[int]]) -> WritePlan:
    """items: per request (window, old length, new rows, row offset); ``pages[i]``: request ``i``'s page ids,
    covering its slot indices up to the end of its last group. Every request's rows at once, in numpy."""
    codec, cap, g, ps = storage.codec, storage.capacity, storage.codec.group, storage.spec.page_size
    columns = zip(*items) if items else [()] * 4
    w, old, n, row0 = (np.asarray(col, dtype=np.int64).reshape(-1) for col in columns)
    new = old + n
    first, last = old // g * g, -(-new // g) * g
    idx = _ragged_arange(first, last - first)  # each request's slot indices [first, last): its open groups
    req = np.repeat(np.arange(len(items)), last - first)
    p = np.minimum(idx, new[req] - 1)  # slots past the new rows repeat the last one (re-encoded as it fills)
    held = [pages[i][f // ps:-(-e // ps)] for i, (f, e) in enumerate(zip(first.tolist(), last.tolist()))]
    held_at = np.cumsum([0] + [len(h) for h in held])[:-1]
    flat = np.asarray([x for h in held for x in h], dtype=np.int64)
    slots = flat[held_at[req] + idx // ps - first[req] // ps] * ps + idx % ps if idx.size else idx
    quant = np.maximum(0, (new - codec.residual) // g * g) if codec.has_window else new
    lo = np.maximum(quant, old)
    pos = _ragged_arange(lo, np.maximum(new - lo, 0))  # the new rows the window keeps
    pos_req = np.repeat(np.arange(len(items)), np.maximum(new - lo, 0))
    device = storage.spec.device

    def to(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    return WritePlan(from_ring=to(p < old[req]), ring_src=to(w[req] * cap + p % cap),
                     row_src=to(np.maximum(row0[req] + p - old[req], 0)), group_slots=to(slots),
                     ring_dst=to(w[pos_req] * cap + pos % cap), ring_rows=to(row0[pos_req] + pos - old[pos_req]))

def plan_decode(storage: CodedStorage, kv_lens: torch.Tensor, window_ids: torch.Tensor,
                block_tables: torch.Tensor, page_size: int) -> list[WritePlan]:
    """``plan_rows`` of a pure-decode step for every layer at once (``kv_lens`` [L, B], lengths after the step;
    request ``i``'s one new row is row ``i``), built on the device with fixed shapes (per layer ``B *
    group`` group slots and ``B`` ring writes) so a decode CUDA graph can capture it. A new row the window
    does not keep (already past the codes' edge) is written to the scratch window instead."""
    codec, cap, g = storage.codec, storage.capacity, storage.codec.group
    num_layers, b = kv_lens.shape
    device = kv_lens.device
    new = kv_lens.long()  # [L, B]
    old = new - 1
    rows = torch.arange(b, device=device)
    first = old // g * g
    pos = first[..., None] + torch.arange(g, device=device)  # [L, B, g] the open group's slots
    p = torch.minimum(pos, old[..., None])  # slots past the new row repeat it (re-encoded as the group fills)
    w = window_ids.long()
    group_slots = block_tables[rows[:, None], pos // page_size].long() * page_size + pos % page_size
    ring_dst = torch.where(codec.quant_lens(new) <= old, w * cap + old % cap, storage.scratch_window * cap)  # [L, B]
    from_ring = (p < old[..., None]).flatten(1)
    ring_src = (w[:, None] * cap + p % cap).flatten(1)
    group_slots = group_slots.flatten(1)
    row_src = rows[:, None].expand(b, g).flatten()
    return [WritePlan(from_ring=from_ring[i], ring_src=ring_src[i], row_src=row_src, group_slots=group_slots[i],
                      ring_dst=ring_dst[i], ring_rows=rows) for i in range(num_layers)]


@dataclass
class DeferredWritePlans:
    """A step's host write plans, not yet built: per layer (one entry when every request's layers have one
    length) the (window, old length, new rows, row offset) of each request, and their page lists. Built on
    the first write that needs them: a replayed decode graph writes from its own device plan and never does."""

    storage: CodedStorage
    items: list[list[tuple[int, int, int, int]]]
    pages: list[list[int]]
    num_layers: int

    def build(self) -> list[WritePlan]:
        plans = [plan_rows(self.storage, items, self.pages) for items in self.items]
        return plans * self.num_layers if len(plans) == 1 else plans
