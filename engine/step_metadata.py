"""A step's KV metadata from the requests' page tables: where the new tokens go (slot mapping), the page
tables attention reads (block tables) and the attention views, per step or per layer.

Host work on every step, so it is built in numpy or in one comprehension over the requests, never a page walk
per request and layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.contract.cache import CacheSpec
from engine.contract.storage import KVStorage
from engine.contract.view import PagedView
from engine.page_table import PageTable, extend_slot_list


class StepMetadata:
    def __init__(self, spec: CacheSpec, storage: KVStorage):
        self.spec, self.storage = spec, storage
        self.page_size = spec.page_size

    def slot_mapping(self, tables: list[PageTable], num_new_tokens: list[int]) -> torch.Tensor:
        """[T] when every request has one length across layers, else [num_layers, T]. The storage plans the
        step's writes from the same tables."""
        self.storage.plan_step(tables, num_new_tokens)
        uniform = all(t.is_uniform() for t in tables)
        if tables and all(n == 1 for n in num_new_tokens):  # a decode step: one slot per request and layer
            return self._decode_slots(tables, uniform).to(self.spec.device)
        if uniform:
            slots: list[int] = []
            for t, n in zip(tables, num_new_tokens):
                extend_slot_list(t.pages, t.layer_len(0), n, self.page_size, slots)
            return torch.tensor(slots, dtype=torch.int64, device=self.spec.device)
        rows = []
        for layer in range(self.spec.num_layers):
            slots = []
            for t, n in zip(tables, num_new_tokens):
                extend_slot_list(t.pages, t.layer_len(layer), n, self.page_size, slots)
            rows.append(slots)
        return torch.tensor(rows, dtype=torch.int64, device=self.spec.device)

    def _decode_slots(self, tables: list[PageTable], uniform: bool) -> torch.Tensor:
        """The next slot of every request ([B], or [num_layers, B] when its layers differ in length): one
        comprehension over the requests, or numpy over the padded page table and the per-layer lengths."""
        ps = self.page_size
        if uniform:
            return torch.tensor([t.pages[n // ps] * ps + n % ps for t in tables for n in (t.layer_len(0),)],
                                dtype=torch.int64)
        lens = self.layer_lens(tables)  # [L, B]
        pages = self.host_block_tables(tables).numpy().astype(np.int64)  # [B, P]
        slots = np.take_along_axis(pages, (lens // ps).T, axis=1).T * ps + lens % ps
        return torch.from_numpy(np.ascontiguousarray(slots))

    def layer_lens(self, tables: list[PageTable]) -> np.ndarray:
        """[num_layers, B] C-contiguous int64 array of each request's slots in use per layer (numpy: a nested
        list converts several times faster than through torch.tensor at a few hundred requests x 32 layers).
        Contiguous, so that a layer's row of the lengths built from it is a contiguous tensor: the kernels index
        it by request, and a transposed array would keep a stride of num_layers through ``+`` and ``astype``."""
        num_layers = self.spec.num_layers
        rows = [[t.num_slots] * num_layers if t.layer_lens is None else t.layer_lens for t in tables]
        return np.ascontiguousarray(np.array(rows, dtype=np.int64).reshape(len(tables), num_layers).T)

    @staticmethod
    def host_block_tables(tables: list[PageTable]) -> torch.Tensor:
        """[B, max_pages] int32 host page table (padding entries page 0), filled row by row from each table's
        cached numpy row (several times faster than ``pad_sequence`` over torch rows at a few hundred
        requests)."""
        width = max((len(t.pages) for t in tables), default=0)
        out = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            out[i, :len(t.pages)] = t.pages_row()
        return torch.from_numpy(out)

    def block_tables(self, tables: list[PageTable]) -> torch.Tensor:
        """Copied from pinned memory without waiting: a plain host-to-GPU copy waits for all the work queued
        on the stream, and an overlapped decode window is launched while the previous one runs."""
        host = self.host_block_tables(tables)
        if self.spec.device.type != "cuda":
            return host
        return host.pin_memory().to(self.spec.device, non_blocking=True)

    def build_view(self, tables: list[PageTable], num_new_tokens: list[int], layer: int = 0) -> PagedView:
        kv_lens = [t.layer_len(layer) + n for t, n in zip(tables, num_new_tokens)]
        block_tables = self.host_block_tables(tables)  # padding entries are page 0, never read
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        device = self.spec.device
        common = dict(
            block_tables=block_tables.to(device),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            page_size=self.page_size,
            kv_lens_cpu=kv_lens,
            query_lens_cpu=list(num_new_tokens),
        )
        return self.storage.view(common, tables, num_new_tokens, layer)

    def build_layer_views(self, tables: list[PageTable], num_new_tokens: list[int]) -> list[PagedView] | None:
        """One view per layer when some request's layers differ in length or the storage's views are per layer;
        None when ``build_view`` serves all."""
        uniform = all(t.is_uniform() for t in tables)
        per_layer = self.storage.per_layer_views
        if not per_layer and uniform:
            return None
        num_layers = self.spec.num_layers
        if uniform:  # one set of tables and lengths; only the layer's storage differs
            base = self.build_view(tables, num_new_tokens)
            return [base] + [self.storage.layer_view(base, layer) for layer in range(1, num_layers)]
        if not per_layer:  # lengths differ per layer: one page table, one host->device copy of the lengths
            base = self.build_view(tables, num_new_tokens)
            lens_np = self.layer_lens(tables) + np.asarray(num_new_tokens, dtype=np.int64)
            lens = lens_np.tolist()
            lens_t = torch.from_numpy(lens_np.astype(np.int32)).to(self.spec.device)
            return [dataclasses.replace(base, kv_lens=lens_t[layer], kv_lens_cpu=lens[layer])
                    for layer in range(num_layers)]
        return [self.build_view(tables, num_new_tokens, layer) for layer in range(num_layers)]
