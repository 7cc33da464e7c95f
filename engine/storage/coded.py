"""Codec-encoded KV (see ``engine.contract.codec``): a ``KVStorage`` whose tokens are stored as a codec's fields.

``CodedStorage`` owns, per side (k, v) and codec field, a tensor ``[num_layers, num_pages, page_size // g,
num_kv_heads, width]`` (physical slot ``s`` = page ``s // page_size``, offset ``s % page_size``; per-group
fields at ``s // token_group`` of the flattened page axis), plus, for codecs with a window, a
full-precision ring ``[num_layers, 2, max_windows + 1, capacity, num_kv_heads, head_dim]`` whose last
window is scratch. A running table holds a window (``open_table``), loaded from its codes; the attention view
of each layer reads its first ``quant_len`` slots from the codes and the rest from the window.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

import torch

from engine.contract.codec import CodedCacheSpec, KVCodec, TensorCodec
from engine.contract.storage import KVStorage, TableHandle
from engine.contract.view import PagedView, QuantizedPagesView
from engine.kv_memory import zeroed
from engine.page_table import physical_slots
from engine.storage.write_plans import DeferredWritePlans, WritePlan, plan_decode, plan_rows


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


class CodedStorage(KVStorage):
    per_layer_views = True  # each layer's view holds that layer's fields
    cuts_appended_tokens = False  # appended tokens share groups with kept ones

    def __init__(self, spec: CodedCacheSpec, num_pages: int):
        super().__init__(spec, num_pages)
        self.codec = spec.codec
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
        self._write_plans: list[WritePlan] | DeferredWritePlans | None = None
        self._prefix_plan: tuple | None = None  # write_prefix's plan, shared by the layers of one table

    def page_tensors(self):
        """The codes' fields (the full-precision windows are working state, reloaded from codes on open)."""
        return [(f, 1) for side in self.fields.values() for f in side.values()]

    # --- windows --------------------------------------------------------------------------------
    @property
    def scratch_window(self) -> int:
        return self.spec.max_windows

    def acquire_window(self) -> int | None:
        return self._free_windows.pop() if self._free_windows else None

    def release_window(self, w: int) -> None:
        assert w not in self._free_windows
        self._free_windows.append(w)

    def open_table(self, table: TableHandle) -> bool:
        """A codec with a window: give the table one, loaded from its codes; False if every window is taken."""
        if not self.codec.has_window or table.window is not None:
            return True
        table.window = self.acquire_window()
        if table.window is None:
            return False
        layer_slots = []
        for layer in range(self.spec.num_layers):
            n = table.layer_len(layer)
            start = self.codec.quant_len(n)
            layer_slots.append((start, self._slots(table, start, n - start)))
        self.fill_window(table.window, layer_slots)
        return True

    def close_table(self, table: TableHandle) -> None:
        if table.window is not None:  # codes stay valid; the window reloads from them when the table reopens
            self.release_window(table.window)
            table.window = None

    def _slots(self, table: TableHandle, start: int, n: int) -> torch.Tensor:
        return physical_slots(table.pages, start, n, self.spec.page_size, self.spec.device)

    def quant_len(self, table: TableHandle, layer: int, extra: int = 0) -> int:
        """Slots of ``layer`` attention reads from codes (the rest from the window)."""
        n = table.layer_len(layer) + extra
        return self.codec.quant_len(n) if table.window is not None else n

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
    def plan_step(self, tables: list[TableHandle], num_new_tokens: list[int]) -> None:
        """Under a codec with a window: the step's write plans, built on the first write that needs them.
        Lengths, windows and page lists are taken now, as the step is prepared."""
        if not self.codec.has_window:
            return
        rows = [0]
        for n in num_new_tokens:
            rows.append(rows[-1] + n)
        pages = [t.pages for t in tables]
        layers = [0] if all(t.is_uniform() for t in tables) else range(self.spec.num_layers)
        items = [[(t.window, t.layer_len(layer), n, r) for t, n, r in zip(tables, num_new_tokens, rows)]
                 for layer in layers]
        self._write_plans = DeferredWritePlans(self, items, pages, self.spec.num_layers)

    def plan_decode(self, views: list[PagedView]) -> None:
        """Under a codec with a window: the new rows into the rings and the open groups re-encoded, planned
        from the views' lengths (after the step), window ids and page tables on the device."""
        if self.codec.has_window:
            self._write_plans = plan_decode(self, torch.stack([v.kv_lens for v in views]), views[0].window_ids,
                                            views[0].block_tables, self.spec.page_size)

    def write(self, layer, k, v, slots, positions=None) -> None:
        if isinstance(self._write_plans, DeferredWritePlans):
            self._write_plans = self._write_plans.build()
        plans = self._write_plans
        self._write_planned(layer, k, v, slots, None if plans is None else plans[layer], positions)

    def write_prefix(self, table: TableHandle, layer, k, v, slots) -> None:
        n = k.shape[0]
        plan = None
        if self.codec.has_window:
            cached = self._prefix_plan
            if cached is None or not (cached[0] is table and cached[1:3] == (n, table.window)):
                items = [(self.scratch_window if table.window is None else table.window, 0, n, 0)]
                self._prefix_plan = (table, n, table.window, plan_rows(self, items, [table.pages]))
            plan = self._prefix_plan[3]
        self._write_planned(layer, k, v, slots, plan, torch.arange(n, device=k.device))

    def _write_planned(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
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

    def gather_kept(self, layer: int, table: TableHandle, old_slots: torch.Tensor,
                    keep: torch.Tensor) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor] | None]]:
        """Before a compaction: for slot indices ``keep`` [H, n] (physical slots ``old_slots[keep]``), per side
        the full-precision values [n, H, D] (the window's where it holds them) and, for token-local codecs, the
        raw fields to move exactly."""
        window, quant_len = table.window, self.quant_len(table, layer)
        slots = old_slots[keep]
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

    def scatter_kept(self, layer: int, table: TableHandle, kept, new_phys: torch.Tensor) -> None:
        """After a compaction: kept (from ``gather_kept``) becomes slots 0..n-1 at physical ``new_phys``
        (covering whole groups)."""
        window = table.window
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

    def compacted_slots(self, n: int) -> int:
        return cdiv(n, self.codec.group) * self.codec.group

    # --- reads ----------------------------------------------------------------------------------
    def layer_kv(self, layer: int) -> tuple[DecodedPages, DecodedPages]:
        """``DecodedPages`` readers (decoded on indexing), not tensors."""
        return DecodedPages(self, layer, "k"), DecodedPages(self, layer, "v")

    def view(self, common, tables, num_new_tokens, layer) -> QuantizedPagesView:
        device = self.spec.device
        quant = [self.quant_len(t, layer, n) for t, n in zip(tables, num_new_tokens)]
        windows = None
        if self.codec.has_window:
            windows = [self.scratch_window if t.window is None else t.window for t in tables]
        common = dict(common, codec=self.codec, quant_lens=torch.tensor(quant, dtype=torch.int32, device=device),
                      quant_lens_cpu=quant, window_ids_cpu=windows,
                      window_ids=None if windows is None else torch.tensor(windows, dtype=torch.int32, device=device))
        return self._layer_view(common, layer)

    def layer_view(self, view: QuantizedPagesView, layer: int) -> QuantizedPagesView:
        """``view`` with ``layer``'s fields: the view of a layer whose tables and lengths equal ``view``'s."""
        common = {f.name: getattr(view, f.name) for f in dataclass_fields(QuantizedPagesView)
                  if f.name not in ("k_fields", "v_fields", "window_k", "window_v", "layer")}
        return self._layer_view(common, layer)

    def _layer_view(self, common: dict, layer: int) -> QuantizedPagesView:
        k_fields, v_fields, window_k, window_v = self.per_layer_fields[layer]
        return QuantizedPagesView(**common, layer=layer, k_fields=k_fields, v_fields=v_fields, window_k=window_k,
                                  window_v=window_v)

