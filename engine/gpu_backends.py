"""GPU attention backends: Triton kernels (ours) and flashinfer (optional, imported lazily).

Both read the same paged layout as the torch reference (``k_cache``/``v_cache`` [num_pages, page_size,
Hkv, D]) and the same views. Pure-decode steps take the split-context decode kernel; anything with a
query longer than one token takes the paged prefill/extend kernel, which handles mixed steps too.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.attention_backend import RECEIVED_REDUCTIONS, AttentionBackend, latent_quantized_forward, quantized_forward
from engine.contract.view import PagedView, QuantizedLatentView, QuantizedPagesView, SelectedSlotsView


class TritonBackend(AttentionBackend):
    """Reads paged and selected-page views directly, selected-slot views as a page-size-1 table over the
    flattened cache. Scores (for methods that rank slots by attention) come from the decode-logits kernel
    at decode steps and from the torch reference ops (on the GPU) for prefill chunks."""

    name = "triton"
    accepted_views = (PagedView, SelectedSlotsView, QuantizedPagesView, QuantizedLatentView)
    supports_scores = True
    cuda_graph_safe = True
    latent_dims = (512, 64)  # the MLA decode / prefill tiles compiled for sm_90a without spills (their tests)

    def reads_codec(self, codec, head_dim=None) -> bool:
        from agentrt_kernels.triton.quant_decode import FORMATS, unsupported_shape

        fmt = codec.kernel_format
        return fmt in FORMATS and (head_dim is None or unsupported_shape(fmt, head_dim) is None)

    def reads_latent_rows(self, row_codec) -> bool:
        from agentrt_kernels.triton.mla_decode import LATENT_ROW_FORMATS

        return row_codec.kernel_format in LATENT_ROW_FORMATS

    def _coded_latent(self, q, view: QuantizedLatentView, scale: float, return_scores: bool):
        """Latent rows stored by a codec: decode rows read the codes in the MLA decode kernel; prompt chunks and
        mixed steps attend over the step's pages decoded to q's dtype (once per layer, then the MLA prefill
        kernel); scores come from the torch reference."""
        if return_scores:
            return latent_quantized_forward(q, view, scale, True)
        if view.is_pure_decode:
            from agentrt_kernels.triton.mla_decode import coded_rows, mla_paged_decode

            codes, row_scales = coded_rows(view.row_codec.kernel_format, view.k_fields)
            return mla_paged_decode(q, codes, view.block_tables, view.kv_lens, scale, view.value_dim,
                                    row_scales=row_scales), None
        from agentrt_kernels.triton.mla_prefill import mla_paged_prefill

        pages, table = torch.unique(view.block_tables, return_inverse=True)
        rows = view.row_codec.decode({name: f[pages.long()] for name, f in view.k_fields.items()}, q.shape[-1])
        return mla_paged_prefill(q, rows.to(q.dtype), table.to(torch.int32), view.kv_lens, view.query_start_loc,
                                 scale, view.value_dim, causal=view.causal, max_query_len=view.max_query_len), None

    def _quantized(self, q, view: QuantizedPagesView, scale: float, return_scores: bool):
        """Decode rows: the fused dequantizing kernel; prefill chunks and scores: the torch reference."""
        if return_scores:
            return quantized_forward(q, view, scale, return_scores)
        from agentrt_kernels.triton.quant_decode import quantized_decode_attention

        if view.is_pure_decode:
            return quantized_decode_attention(
                q, view.codec.kernel_format, view.k_fields, view.v_fields, view.block_tables, view.kv_lens,
                view.quant_lens, view.window_k, view.window_v, view.window_ids, scale,
                tables=view.codec.kernel_tables(q.shape[-1], q.device, view.layer)), None
        out, start = torch.empty_like(q), 0
        rows: dict[bool, tuple[list[int], list[int]]] = {True: ([], []), False: ([], [])}
        for i, n in enumerate(view.query_lens_cpu):
            rows[n == 1][0].append(i)
            rows[n == 1][1].extend(range(start, start + n))
            start += n
        for decode, (reqs, qrows) in rows.items():
            if reqs:
                part = q[torch.tensor(qrows, device=q.device)]
                sub = _sub_view(view, reqs)
                o = self._quantized(part, sub, scale, False)[0] if decode else quantized_forward(part, sub, scale)[0]
                out[torch.tensor(qrows, device=q.device)] = o
        return out, None

    def __init__(self, device: torch.device | None = None) -> None:
        from agentrt_kernels.triton import paged_decode_attention, paged_decode_logits, paged_prefill_attention

        self._decode = paged_decode_attention
        self._logits = paged_decode_logits
        self._prefill = paged_prefill_attention
        self._slot_table: tuple[SelectedSlotsView, torch.Tensor] | None = None  # per view: layers share it

    def forward(self, q, k_cache, v_cache, view: PagedView, scale: float, return_scores: bool = False):
        if isinstance(view, QuantizedLatentView):
            return self._coded_latent(q, view, scale, return_scores)
        if isinstance(view, QuantizedPagesView):
            return self._quantized(q, view, scale, return_scores)
        if v_cache.shape[-1] != k_cache.shape[-1] and not (return_scores and not view.is_pure_decode):
            return self._latent(q, k_cache, v_cache.shape[-1], view, scale, return_scores)
        if return_scores and not view.is_pure_decode:
            from agentrt_kernels.torch_ref import paged_attention, selected_slots_attention

            if isinstance(view, SelectedSlotsView):
                return selected_slots_attention(
                    q, k_cache, v_cache, view.slot_indptr, view.slot_indices, scale,
                    query_lens=view.query_lens_cpu, slot_counts=view.kv_lens_cpu, causal=view.causal,
                    return_scores=True)
            return paged_attention(q, k_cache, v_cache, view.block_tables, view.kv_lens_cpu, view.query_lens_cpu,
                                   scale, causal=view.causal, return_scores=True)
        block_tables = view.block_tables
        if isinstance(view, SelectedSlotsView):
            k_cache, v_cache = k_cache.flatten(0, 1).unsqueeze(1), v_cache.flatten(0, 1).unsqueeze(1)
            if view.slot_table is not None:
                block_tables = view.slot_table
            else:
                if self._slot_table is None or self._slot_table[0] is not view:
                    self._slot_table = (view, _slot_table(view))
                block_tables = self._slot_table[1]
        if view.is_pure_decode:
            out = self._decode(q, k_cache, v_cache, block_tables, view.kv_lens, scale)
            if not return_scores:
                return out, None
            logits = self._logits(q, k_cache, block_tables, view.kv_lens, scale, max(view.kv_lens_cpu, default=0))
            probs = torch.softmax(logits, dim=-1)
            return out, [probs[i, :, None, :n] for i, n in enumerate(view.kv_lens_cpu)]
        return self._prefill(q, k_cache, v_cache, block_tables, view.kv_lens, view.query_start_loc, scale,
                             causal=view.causal, max_query_len=view.max_query_len), None


    def _latent(self, q, latent, value_dim: int, view: PagedView, scale: float, return_scores: bool):
        """A latent (MLA) cache: one KV head whose values are its rows' first ``value_dim`` channels. Decode rows
        take the MLA decode kernel (``agentrt_kernels.triton.mla_decode``), prefill chunks and mixed steps the MLA
        prefill kernel (``agentrt_kernels.triton.mla_prefill``)."""
        block_tables = view.block_tables
        if isinstance(view, SelectedSlotsView):
            latent = latent.flatten(0, 1).unsqueeze(1)
            if view.slot_table is not None:
                block_tables = view.slot_table
            else:
                if self._slot_table is None or self._slot_table[0] is not view:
                    self._slot_table = (view, _slot_table(view))
                block_tables = self._slot_table[1]
        if not view.is_pure_decode:
            from agentrt_kernels.triton.mla_prefill import mla_paged_prefill

            return mla_paged_prefill(q, latent, block_tables, view.kv_lens, view.query_start_loc, scale, value_dim,
                                     causal=view.causal, max_query_len=view.max_query_len), None
        from agentrt_kernels.triton.mla_decode import mla_paged_decode

        out = mla_paged_decode(q, latent, block_tables, view.kv_lens, scale, value_dim)
        if not return_scores:
            return out, None
        logits = self._logits(q, latent, block_tables, view.kv_lens, scale, max(view.kv_lens_cpu, default=0))
        probs = torch.softmax(logits, dim=-1)
        return out, [probs[i, :, None, :n] for i, n in enumerate(view.kv_lens_cpu)]

    def forward_received(self, q, k_cache, v_cache, view: PagedView, scale: float, num_kv_heads: int,
                         reduce: str = "sum"):
        """Plain paged views: the prefill/extend kernel also writes each row's log-sum-exp, and a second
        kernel reduces the recomputed probabilities per slot, so no probability matrix is held."""
        if type(view) is not PagedView or reduce not in RECEIVED_REDUCTIONS or v_cache.shape[-1] != k_cache.shape[-1]:
            return super().forward_received(q, k_cache, v_cache, view, scale, num_kv_heads, reduce)
        from agentrt_kernels.triton.received_attention import received_attention

        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        out = self._prefill(q, k_cache, v_cache, view.block_tables, view.kv_lens, view.query_start_loc, scale,
                            causal=view.causal, max_query_len=view.max_query_len, lse=lse)
        received = received_attention(q, k_cache, view.block_tables, view.kv_lens, view.query_start_loc, lse,
                                      scale, max(view.kv_lens_cpu, default=0), view.max_query_len,
                                      causal=view.causal, reduce=reduce)
        return out, [received[i, :, :n].clone() for i, n in enumerate(view.kv_lens_cpu)]


def _slot_table(view: SelectedSlotsView) -> torch.Tensor:
    """[B, max listed] int32 flat slots per request (a page table over pages of one slot), padded with 0."""
    width = max(view.kv_lens_cpu, default=0)
    cols = torch.arange(width, device=view.slot_indptr.device)
    flat = view.slot_indptr[:-1, None] + cols[None, :]
    valid = cols[None, :] < view.kv_lens[:, None].to(cols.dtype)
    last = max(view.slot_indices.shape[0] - 1, 0)
    return torch.where(valid, view.slot_indices[flat.clamp(max=last)], 0).to(torch.int32)


def _sub_view(view: QuantizedPagesView, reqs: list[int]) -> QuantizedPagesView:
    """The view of requests ``reqs`` only (their queries packed in order)."""
    idx = torch.tensor(reqs, device=view.kv_lens.device)
    qlens = [view.query_lens_cpu[i] for i in reqs]
    starts = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(idx.device)
    wids = None if view.window_ids is None else view.window_ids[idx]
    return dataclasses.replace(
        view, block_tables=view.block_tables[idx], kv_lens=view.kv_lens[idx], query_start_loc=starts,
        kv_lens_cpu=[view.kv_lens_cpu[i] for i in reqs], query_lens_cpu=qlens, quant_lens=view.quant_lens[idx],
        quant_lens_cpu=[view.quant_lens_cpu[i] for i in reqs], window_ids=wids,
        window_ids_cpu=None if wids is None else [view.window_ids_cpu[i] for i in reqs])


class FlashInferBackend(AttentionBackend):
    """flashinfer's paged decode (tensor cores, the faster GQA configuration) and paged prefill wrappers, and its
    MLA wrapper for latent caches.

    ``plan`` runs once per view (once per step when every layer reads the same view) and ``run`` per layer.
    """

    name = "flashinfer"  # cuda_graph_safe stays False: it plans on the host every step
    dtypes = (torch.float16, torch.bfloat16)
    head_dims = (64, 128, 256)  # its prefill kernels fail at run time on others ("Invalid configuration")
    latent_dims = (512, 64)  # its MLA kernels are built for DeepSeek's latent and rope sizes
    WORKSPACE_BYTES = 256 * 2**20

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._mla = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        self._planned_view: PagedView | None = None  # held, so its id cannot be reused by a later view
        self._planned_mla_view: PagedView | None = None

    def unsupported(self, method, dtype=None, codec=None, head_dim=None, value_dim=None) -> list[str]:
        reasons = super().unsupported(method, dtype, codec, head_dim, value_dim)
        if (head_dim is not None and value_dim is not None and value_dim != head_dim
                and (value_dim, head_dim - value_dim) != self.latent_dims):
            reasons.append(f"the {self.name} backend's MLA wrapper runs kv_lora_rank {self.latent_dims[0]} with "
                           f"qk_rope_head_dim {self.latent_dims[1]} only (this model: kv_lora_rank {value_dim}, "
                           f"qk_rope_head_dim {head_dim - value_dim})")
        return reasons

    @staticmethod
    def _pages(view: PagedView, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(indptr [B + 1], indices): each request's pages, concatenated, as flashinfer's wrappers take them."""
        pages_per = [-(-n // page_size) for n in view.kv_lens_cpu]
        indices = torch.cat([view.block_tables[i, :n] for i, n in enumerate(pages_per)])
        indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0).tolist()), dtype=torch.int32,
                              device=device)
        return indptr, indices

    def _plan(self, q, k_cache, view: PagedView, scale: float) -> bool:
        decode = view.is_pure_decode
        if self._planned_view is view:
            return decode
        page_size = k_cache.shape[1]
        indptr, indices = self._pages(view, page_size, q.device)
        last = torch.tensor([(n - 1) % page_size + 1 for n in view.kv_lens_cpu], dtype=torch.int32, device=q.device)
        hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
        if decode:
            self._decode.plan(indptr, indices, last, hq, hkv, d, page_size, sm_scale=scale,
                              q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        else:
            self._prefill.plan(view.query_start_loc, indptr, indices, last, hq, hkv, d, page_size,
                               causal=view.causal, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        self._planned_view = view
        return decode

    def forward(self, q, k_cache, v_cache, view: PagedView, scale: float, return_scores: bool = False):
        assert not return_scores, "methods that need scores run on the torch backend (checked at configuration)"
        if v_cache.shape[-1] != k_cache.shape[-1]:
            return self._latent(q, k_cache, v_cache.shape[-1], view, scale), None
        decode = self._plan(q, k_cache, view, scale)
        wrapper = self._decode if decode else self._prefill
        return wrapper.run(q, (k_cache, v_cache)), None

    def _latent(self, q, latent, value_dim: int, view: PagedView, scale: float) -> torch.Tensor:
        """A latent (MLA) cache through flashinfer's MLA wrapper: the rows' first ``value_dim`` channels are its
        compressed KV, the rest its rope keys (two strided views of the one row, nothing copied); decode rows,
        prompt chunks and mixed steps in one plan per view (causal, queries at their rows' ends)."""
        page_size = latent.shape[1]
        if self._planned_mla_view is not view:
            indptr, indices = self._pages(view, page_size, q.device)
            self._mla.plan(view.query_start_loc, indptr, indices, view.kv_lens, q.shape[1], value_dim,
                           latent.shape[-1] - value_dim, page_size, causal=view.causal and not view.is_pure_decode,
                           sm_scale=scale, q_data_type=q.dtype, kv_data_type=latent.dtype)
            self._planned_mla_view = view
        rows = latent[:, :, 0]
        return self._mla.run(q[..., :value_dim].contiguous(), q[..., value_dim:].contiguous(), rows[..., :value_dim],
                             rows[..., value_dim:])



class TritonFlashInferBackend(TritonBackend):
    """The Triton backend, with flashinfer's paged prefill for the steps it is faster at: prompt chunks and
    mixed steps over plain paged views in fp16/bf16 with a head size flashinfer runs (1.5x our prefill kernel
    at 8K-32K on an H200, docs/benchmarks.md). Decode steps stay on Triton, so decode CUDA graphs still
    replay; selections, coded views, scores and fp32 stay on Triton too."""

    name = "triton+flashinfer"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._flashinfer = FlashInferBackend(device)

    def forward(self, q, k_cache, v_cache, view: PagedView, scale: float, return_scores: bool = False):
        if (type(view) is PagedView and not view.is_pure_decode and not return_scores
                and q.dtype in FlashInferBackend.dtypes and q.shape[-1] in FlashInferBackend.head_dims):
            return self._flashinfer.forward(q, k_cache, v_cache, view, scale)
        return super().forward(q, k_cache, v_cache, view, scale, return_scores)
