"""Decode CUDA graphs over bucketed batch sizes.

A pure-decode step of B requests replays the graph of the smallest bucket >= B. The graph was captured
over static buffers (token ids, positions, block tables, and per layer the slot mapping and kv lengths);
padding rows write their KV into the cache's scratch page and read one slot of it. Every layer reads its
own row of lengths and slots, so steps whose layers hold different physical lengths (eviction with
per-layer budgets) replay too; the page tables are the same for every layer. Python does not run during
replay, so no per-layer hook runs on a replayed step: only steps whose methods allow it replay
(``DecodeCapabilities.replay``; work a method declares ``graph_hooks`` is part of the capture). Under a KV
storage codec the static views are the layers' ``QuantizedPagesView`` s over the codec's side tensors (a coded
latent storage's ``QuantizedLatentView`` s, which hold no per-request fields); a codec
with a full-precision window also gets each row's window id and codes length in static buffers, and its
writes (the new row into the ring, the open group re-encoded) are planned on the device from the static
buffers inside the graph (``CodedStorage.plan_decode``).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from engine.contract.view import PagedView, QuantizedLatentView, QuantizedPagesView
from engine.forward_batch import ForwardBatch
from engine.storage.coded import CodedStorage

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


# the views a replay's static buffers stand for (a coded latent view reads its codes in place, as eager steps do)
_STATIC_VIEWS = (PagedView, QuantizedPagesView, QuantizedLatentView)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_pages: int, scratch_page: int, page_size: int):
        self.runner = runner
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * page_size
        self.page_size = page_size
        dev = runner.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        layers = runner.cache.spec.num_layers
        self.slot_mapping = torch.full((layers, max_batch), self.scratch_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((max_batch, max_pages), scratch_page, dtype=torch.int32, device=dev)
        self.kv_lens = torch.ones(layers, max_batch, dtype=torch.int32, device=dev)
        storage = runner.cache.storage
        coded = storage if isinstance(storage, CodedStorage) else None
        self.windowed = coded is not None and coded.codec.has_window
        if self.windowed:  # a codec's full-precision windows: each row's ring and how many slots codes hold
            self.scratch_window = coded.scratch_window
            self.window_ids = torch.full((max_batch,), self.scratch_window, dtype=torch.int32, device=dev)
            self.quant_lens = torch.ones(layers, max_batch, dtype=torch.int32, device=dev)
        # a hybrid model's rows' recurrent-state slots (padding rows: the storage's scratch slot)
        self.scratch_state = storage.scratch_state if runner.cache.spec.recurrent_layers else None
        self.state_slots = None if self.scratch_state is None else torch.full(
            (max_batch,), self.scratch_state, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by a replay (for benchmarks and logs)
        # a replay whose live rows fill less than its bucket reads one KV slot for each padding row, so it is
        # less work than a full step of the bucket's size: benchmarks time full buckets only (benchmarks.throughput)
        self.padded_replays = 0
        self.last_rows: tuple[int, int] | None = None  # (live rows, bucket) of the last replay

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def _static_batch(self, b: int) -> ForwardBatch:
        views = [self._static_view(layer, b) for layer in range(self.kv_lens.shape[0])]
        return ForwardBatch(
            requests=[], num_new_tokens=[1] * b,
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:, :b],
            view=views[0], layer_views=views, logits_indices=self.query_start_loc[:b].long(),
            sample_requests=[], finished_prompt=[], cache=self.runner.cache, method=self.runner.method,
            state_slots=None if self.state_slots is None else self.state_slots[:b],
        )

    def _static_view(self, layer: int, b: int) -> PagedView:
        common = dict(block_tables=self.block_tables[:b], kv_lens=self.kv_lens[layer, :b],
                      query_start_loc=self.query_start_loc[: b + 1], page_size=self.page_size,
                      kv_lens_cpu=[1] * b, query_lens_cpu=[1] * b)
        storage = self.runner.cache.storage
        coded = storage if isinstance(storage, CodedStorage) else None
        if coded is None:  # the storage's own view over the static fields (a coded latent's, a plain one)
            return storage.view(common, [], [1] * b, layer)
        fields = dict(codec=coded.codec, layer=layer, k_fields={k: f[layer] for k, f in coded.fields["k"].items()},
                      v_fields={k: f[layer] for k, f in coded.fields["v"].items()}, quant_lens_cpu=[1] * b)
        if not self.windowed:  # every slot from codes: quant lengths = lengths
            return QuantizedPagesView(**common, **fields, quant_lens=self.kv_lens[layer, :b])
        return QuantizedPagesView(**common, **fields, quant_lens=self.quant_lens[layer, :b],
                                  window_ids=self.window_ids[:b], window_ids_cpu=[self.scratch_window] * b,
                                  window_k=coded.ring[layer, 0], window_v=coded.ring[layer, 1])

    def _forward(self, b: int) -> torch.Tensor:
        runner = self.runner
        runner.cache.plan_decode_writes(runner._batch)  # a codec's window writes, from the static buffers
        hidden = runner.model(self.input_ids[:b], self.positions[:b], runner)
        return runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, show_progress: bool = True) -> None:
        pool = None
        for b in tqdm(sorted(self.buckets, reverse=True), desc="capturing decode CUDA graphs",
                      disable=not show_progress):
            self.runner._batch = self._static_batch(b)
            for _ in range(2):
                self._forward(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        self.runner._batch = None
        torch.cuda.synchronize()

    def load(self, batch: ForwardBatch) -> int:
        """Copy ``batch``'s inputs into the static buffers (padding rows to the bucket); returns the bucket."""
        n = batch.num_tokens
        b = self.bucket_for(n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:, :n].copy_(batch.slot_mapping.expand(self.slot_mapping.shape[0], n))
        width = batch.view.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.view.block_tables)
        if batch.layer_views is None:
            self.kv_lens[:, :n].copy_(batch.view.kv_lens.expand(self.kv_lens.shape[0], n))
        else:
            self.kv_lens[:, :n].copy_(torch.stack([v.kv_lens for v in batch.layer_views]))
        if self.windowed:
            self.window_ids[:n].copy_(batch.view.window_ids)
            self.quant_lens[:, :n].copy_(torch.stack([v.quant_lens for v in batch.layer_views]))
        if self.state_slots is not None:
            self.state_slots[:n].copy_(self.runner.cache.state_slots(batch.requests))
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[:, n:b].fill_(self.scratch_slot)
            self.block_tables[n:b, 0].fill_(self.scratch_page)
            self.kv_lens[:, n:b].fill_(1)
            if self.windowed:
                self.window_ids[n:b].fill_(self.scratch_window)
                self.quant_lens[:, n:b].fill_(1)
            if self.state_slots is not None:
                self.state_slots[n:b].fill_(self.scratch_state)
        return b

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the decode step of ``batch``; returns logits [B, vocab] (a view into a static buffer)."""
        b = self.load(batch)
        self.graphs[b].replay()
        self.replays += 1
        self.padded_replays += b > batch.num_tokens
        self.last_rows = (batch.num_tokens, b)
        return self.logits[b][: batch.num_tokens]

    @staticmethod
    def can_read(batch: ForwardBatch) -> bool:
        """The static views stand for ``batch``'s: plain paged views or coded ones, one page table shared by
        every layer (and, with a codec's windows, one window per request)."""
        views = batch.layer_views
        if views is None:
            return type(batch.view) in _STATIC_VIEWS
        first = views[0].block_tables
        return all(type(v) in _STATIC_VIEWS
                   and (v.block_tables is first or v.block_tables.shape == first.shape) for v in views)
