"""Storage of codec-encoded KV for the paged cache manager (see ``engine.contract.codec``).

``CodedStorage`` owns, per side (k, v) and codec field, a tensor ``[num_layers, num_pages, page_size // g,
num_kv_heads, width]`` (physical slot ``s`` = page ``s // page_size``, offset ``s % page_size``; per-group
fields at ``s // token_group`` of the flattened page axis), plus, for codecs with a window, a
full-precision ring ``[num_layers, 2, max_windows + 1, capacity, num_kv_heads, head_dim]`` whose last
window is scratch. It knows nothing of requests: the cache manager hands it slots, windows and lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.contract.codec import CodedCacheSpec, KVCodec, TensorCodec
from engine.kv_memory import zeroed


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


class DecodedPages:
    """A read-only ``[num_pages, page_size, Hkv, D]`` view of one layer's keys or values decoded on indexing
    (``x.flatten(0, 1)[slots]``), for methods that score stored keys."""

    def __init__(self, storage: CodedStorage, layer: int, side: str):
        self.storage, self.layer, self.side = storage, layer, side
        s = storage.spec
        self.shape = (storage.num_pages, s.page_size, s.num_kv_heads, s.head_dim)
        self.dtype = s.dtype

    def flatten(self, start: int, end: int) -> DecodedPages:
        assert (start, end) == (0, 1)
        return self

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return self.storage.decode_slots(self.layer, self.side, slots).to(self.dtype)


class CodedStorage:
    def __init__(self, spec: CodedCacheSpec, num_pages: int):
        self.spec, self.codec, self.num_pages = spec, spec.codec, num_pages
        codec: KVCodec = spec.codec
        self.sides: dict[str, TensorCodec] = {"k": codec.key, "v": codec.value}
        self.fields: dict[str, dict[str, torch.Tensor]] = {}
        for side, tc in self.sides.items():
            self.fields[side] = {
                name: zeroed((spec.num_layers, num_pages, spec.page_size // (tc.token_group if f.per_group else 1),
                              spec.num_kv_heads, f.width), f.dtype, spec.device)
                for name, f in tc.fields(spec.head_dim).items()}
        self.capacity = codec.window_capacity
        self.ring: torch.Tensor | None = None
        self._free_windows: list[int] = []
        if codec.has_window:
            self.ring = zeroed((spec.num_layers, 2, spec.max_windows + 1, self.capacity, spec.num_kv_heads,
                                spec.head_dim), spec.dtype, spec.device)
            self._free_windows = list(range(spec.max_windows))
        # per layer: (key fields, value fields, key ring, value ring) as views, made once (every step's
        # per-layer attention views hold them)
        self.per_layer_fields = [
            ({k: f[layer] for k, f in self.fields["k"].items()}, {k: f[layer] for k, f in self.fields["v"].items()},
             None if self.ring is None else self.ring[layer, 0], None if self.ring is None else self.ring[layer, 1])
            for layer in range(spec.num_layers)]

    # --- windows --------------------------------------------------------------------------------
    @property
    def scratch_window(self) -> int:
        return self.spec.max_windows

    def acquire_window(self) -> int | None:
        return self._free_windows.pop() if self._free_windows else None

    def release_window(self, w: int) -> None:
        assert w not in self._free_windows
        self._free_windows.append(w)

    def fill_window(self, w: int, layer_slots: list[tuple[int, torch.Tensor]]) -> None:
        """Load the ring of window ``w`` from codes: per layer, (first slot index, physical slots) of the
        slots ``[quant_len, n)`` the window must hold."""
        for layer, (start, phys) in enumerate(layer_slots):
            if phys.numel() == 0:
                continue
            dst = w * self.capacity + torch.arange(start, start + phys.numel(), device=phys.device) % self.capacity
            for i, side in enumerate(("k", "v")):
                self.ring[layer, i].flatten(0, 1)[dst] = self.decode_slots(layer, side, phys).to(self.ring.dtype)

    # --- encode / decode ------------------------------------------------------------------------
    def store(self, layer: int, side: str, x: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Encode x [N, H, D] (whole groups, in order; logical ``positions`` [N] for codecs that need them) and
        store it at physical ``slots`` [N]."""
        tc = self.codec.layer_codec(layer, side)
        if tc.needs_positions and positions is None:
            raise ValueError(f"kv_storage {self.codec.name!r} stores keys by position: none given")
        tc.store(x, slots, {name: t[layer].flatten(0, 1) for name, t in self.fields[side].items()}, positions)

    def store_fields(self, layer: int, side: str, fields: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        """Store per-slot fields (token-local codecs only) as they are: an exact move."""
        for name, value in fields.items():
            self.fields[side][name][layer].flatten(0, 1).index_copy_(0, slots, value)

    def gather_fields(self, layer: int, side: str, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field per slot at physical ``slots`` ([N] -> [N, H, w]; [H, N] -> [N, H, w], head h of
        row j taken from slot ``slots[h, j]``)."""
        tc = self.sides[side]
        specs = tc.fields(self.spec.head_dim)
        out = {}
        for name, t in self.fields[side].items():
            flat = t[layer].flatten(0, 1)
            idx = slots // tc.token_group if specs[name].per_group else slots
            if idx.dim() == 1:
                out[name] = flat[idx]
            else:
                heads = torch.arange(idx.shape[0], device=idx.device)[None, :]
                out[name] = flat[idx.T, heads]
        return out

    def decode_slots(self, layer: int, side: str, slots: torch.Tensor) -> torch.Tensor:
        return self.codec.layer_codec(layer, side).decode(self.gather_fields(layer, side, slots), self.spec.head_dim)

    # --- a step's writes ------------------------------------------------------------------------
    def plan(self, items: list[tuple[int, int, int, int]], pages: list[list[int]]) -> WritePlan:
        """items: per request (window, old length, new rows, row offset); ``pages[i]``: request ``i``'s page ids,
        covering its slot indices up to the end of its last group. Every request's rows at once, in numpy."""
        codec, cap, g, ps = self.codec, self.capacity, self.codec.group, self.spec.page_size
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
        device = self.spec.device

        def to(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(device)

        return WritePlan(from_ring=to(p < old[req]), ring_src=to(w[req] * cap + p % cap),
                         row_src=to(np.maximum(row0[req] + p - old[req], 0)), group_slots=to(slots),
                         ring_dst=to(w[pos_req] * cap + pos % cap), ring_rows=to(row0[pos_req] + pos - old[pos_req]))

    def plan_decode(self, kv_lens: torch.Tensor, window_ids: torch.Tensor, block_tables: torch.Tensor,
                    page_size: int) -> list[WritePlan]:
        """``plan`` of a pure-decode step for every layer at once (``kv_lens`` [L, B], lengths after the step;
        request ``i``'s one new row is row ``i``), built on the device with fixed shapes (per layer ``B *
        group`` group slots and ``B`` ring writes) so a decode CUDA graph can capture it. A new row the window
        does not keep (already past the codes' edge) is written to the scratch window instead."""
        codec, cap, g = self.codec, self.capacity, self.codec.group
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
        ring_dst = torch.where(codec.quant_lens(new) <= old, w * cap + old % cap, self.scratch_window * cap)  # [L, B]
        from_ring = (p < old[..., None]).flatten(1)
        ring_src = (w[:, None] * cap + p % cap).flatten(1)
        group_slots = group_slots.flatten(1)
        row_src = rows[:, None].expand(b, g).flatten()
        return [WritePlan(from_ring=from_ring[i], ring_src=ring_src[i], row_src=row_src, group_slots=group_slots[i],
                          ring_dst=ring_dst[i], ring_rows=rows) for i in range(num_layers)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              plan: WritePlan | None, positions: torch.Tensor | None = None) -> None:
        if plan is None:
            self.store(layer, "k", k, slot_mapping, positions)
            self.store(layer, "v", v, slot_mapping, positions)
            return
        for i, (side, x) in enumerate((("k", k), ("v", v))):
            ring = self.ring[layer, i].flatten(0, 1)
            x = x.to(ring.dtype)
            if plan.group_slots.numel():
                group = torch.where(plan.from_ring[:, None, None], ring[plan.ring_src], x[plan.row_src])
                self.store(layer, side, group, plan.group_slots)
            ring[plan.ring_dst] = x[plan.ring_rows]

    # --- moves ----------------------------------------------------------------------------------
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        for side in self.fields.values():
            for t in side.values():
                t[:, dst] = t[:, src]

    def gather_kept(self, layer: int, phys: torch.Tensor, keep: torch.Tensor, quant_len: int,
                    window: int | None) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor] | None]]:
        """Before a compaction: for slot indices ``keep`` [H, n] (physical slots ``phys[keep]``), per side the
        full-precision values [n, H, D] (the ring's where it holds them) and, for token-local codecs, the
        raw fields to move exactly."""
        slots = phys[keep]
        out = {}
        for i, side in enumerate(self.sides):
            tc = self.codec.layer_codec(layer, side)
            raw = self.gather_fields(layer, side, slots)
            full = tc.decode(raw, self.spec.head_dim)
            if window is not None:
                heads = torch.arange(keep.shape[0], device=keep.device)[None, :]
                ring = self.ring[layer, i].flatten(0, 1)[(window * self.capacity + keep % self.capacity).T, heads]
                full = torch.where((keep >= quant_len).T[..., None], ring.float(), full)
            out[side] = (full, raw if tc.token_group == 1 else None)
        return out

    def scatter_kept(self, layer: int, kept, new_phys: torch.Tensor, window: int | None) -> None:
        """After a compaction: kept (from ``gather_kept``) becomes slots 0..n-1 at physical ``new_phys``
        (covering whole groups)."""
        for i, (side, tc) in enumerate(self.sides.items()):
            full, raw = kept[side]
            n = full.shape[0]
            if raw is not None:
                self.store_fields(layer, side, raw, new_phys[:n])
            else:
                padded = cdiv(n, tc.token_group) * tc.token_group
                if n:
                    x = torch.cat([full, full[-1:].expand(padded - n, -1, -1)])
                    self.store(layer, side, x, new_phys[:padded])
            if window is not None:
                start = self.codec.quant_len(n)
                dst = window * self.capacity + torch.arange(start, n, device=full.device) % self.capacity
                self.ring[layer, i].flatten(0, 1)[dst] = full[start:].to(self.ring.dtype)
