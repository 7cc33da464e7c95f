"""Attention backends: who computes attention over a view, on which device.

A backend declares the view types it reads and whether it returns scores; ``make_backend`` checks them
against the method at configuration time, never mid-step.
``auto`` picks the fastest backend available on the device and logs which.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.contract.view import PagedView, SelectedSlotsView, backend_can_read
from engine.contract.codec import KVCodec, TensorCodec, decode_pages
from engine.contract.method import SparseMethod
from engine.contract.view import QuantizedLatentView, QuantizedPagesView
from engine.errors import ConfigError

log = logging.getLogger(__name__)

RECEIVED_REDUCTIONS = ("sum", "max")  # how ``forward_received`` folds probabilities over queries and query heads


class AttentionBackend:
    """Computes attention for one layer over a view. Subclasses set what they can read and do."""

    name: ClassVar[str] = "base"
    accepted_views: ClassVar[tuple[type, ...]] = (PagedView,)
    supports_scores: ClassVar[bool] = False  # can return per-request probabilities for methods that need them
    cuda_graph_safe: ClassVar[bool] = False  # forward does no host work, so decode steps may replay graphs

    def __init__(self, device: torch.device | None = None) -> None:
        """Every backend is built from the engine's device (``BACKENDS``); most need nothing of it."""

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: PagedView, scale: float,
        return_scores: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        raise NotImplementedError

    def forward_received(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: PagedView, scale: float,
        num_kv_heads: int, reduce: str = "sum",
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The attention output and, per request, the [Hkv, kv_len] attention each slot receives, summed
        (``reduce="sum"``) or maximised (``"max"``) over the request's queries and each KV head's query heads.
        Plain paged views: the chunked torch reference (no full probability matrix); other views: their
        probabilities, reduced."""
        if reduce not in RECEIVED_REDUCTIONS:
            raise ValueError(f"reduce must be one of {RECEIVED_REDUCTIONS}, got {reduce!r}")
        if type(view) is not PagedView:
            out, probs = self.forward(q, k_cache, v_cache, view, scale, return_scores=True)
            if reduce == "sum":
                return out, [p.sum(dim=1).view(num_kv_heads, -1, p.shape[-1]).sum(dim=1) for p in probs]
            return out, [p.amax(dim=1).view(num_kv_heads, -1, p.shape[-1]).amax(dim=1) for p in probs]
        from agentrt_kernels.torch_ref.received_attention import received_attention

        out, _ = self.forward(q, k_cache, v_cache, view, scale)
        return out, received_attention(q, k_cache, view.block_tables, view.kv_lens_cpu, view.query_lens_cpu,
                                       scale, causal=view.causal, reduce=reduce)

    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: ClassVar[tuple[int, ...] | None] = None  # the head sizes its kernels are built for (None: any)
    # a latent (MLA) cache's widest (kv_lora_rank, qk_rope_head_dim) its kernels run (None: any)
    latent_dims: ClassVar[tuple[int, int] | None] = None

    def reads_codec(self, codec: KVCodec, head_dim: int | None = None) -> bool:
        """Whether a ``QuantizedPagesView`` of this codec (at ``head_dim``, when known) is read (the torch
        reference reads every codec)."""
        return True

    def reads_latent_rows(self, row_codec: TensorCodec) -> bool:
        """Whether ``QuantizedLatentView``s of rows coded by ``row_codec`` are read (asked only of backends that
        accept the view type): the torch reference decodes any codec's rows."""
        return True

    def unsupported(self, method: SparseMethod, dtype: torch.dtype | None = None,
                    codec: KVCodec | None = None, head_dim: int | None = None,
                    value_dim: int | None = None) -> list[str]:
        """Why this backend cannot serve ``method`` on a KV cache of ``dtype`` and ``head_dim`` stored by
        ``codec`` (empty when it can); ``value_dim`` below ``head_dim``: a latent cache (values a slice of keys)."""
        latent = head_dim is not None and value_dim is not None and value_dim != head_dim
        if codec is None:
            view_types = method.view_types
        else:
            view_types = (QuantizedLatentView,) if latent else (QuantizedPagesView,)
        reasons = []
        for t in view_types:
            if backend_can_read(t, self.accepted_views):
                continue
            if t is QuantizedLatentView:
                reasons.append(f"the {self.name} backend does not read latent (MLA) rows coded by kv_storage "
                               f"{codec.name!r} (kv_lora_rank {value_dim} + qk_rope_head_dim {head_dim - value_dim}"
                               f" channels a row; attention_backend 'torch' reads them)")
            else:
                reasons.append(f"the {self.name} backend cannot read {t.__name__}")
        if (codec is not None and latent and not reasons
                and not self.reads_latent_rows(codec.latent_codec(head_dim, value_dim))):
            reasons.append(f"the {self.name} backend has no kernel for latent (MLA) rows coded by kv_storage "
                           f"{codec.name!r}; attention_backend 'torch' reads them")
        if codec is not None and not latent and not reasons and not self.reads_codec(codec, head_dim):
            at = "" if head_dim is None else f" at head_dim {head_dim}"
            reasons.append(f"the {self.name} backend has no kernel for kv_storage {codec.name!r}{at}")
        if dtype is not None and dtype not in self.dtypes:
            reasons.append(f"the {self.name} backend does not run {dtype} (it runs {list(self.dtypes)})")
        if latent and self.latent_dims is not None:
            if value_dim > self.latent_dims[0] or head_dim - value_dim > self.latent_dims[1]:
                reasons.append(f"the {self.name} backend's MLA kernels run kv_lora_rank <= {self.latent_dims[0]} and "
                               f"qk_rope_head_dim <= {self.latent_dims[1]} (this model: kv_lora_rank {value_dim}, "
                               f"qk_rope_head_dim {head_dim - value_dim})")
        elif head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            reasons.append(f"the {self.name} backend does not run head_dim {head_dim} (it runs {list(self.head_dims)})")
        if method.needs.attention_scores and not self.supports_scores:
            reasons.append(f"the {self.name} backend does not return the attention scores {method.name} needs")
        return reasons


class TorchReferenceBackend(AttentionBackend):
    name = "torch"
    accepted_views = (PagedView, SelectedSlotsView, QuantizedPagesView, QuantizedLatentView)
    supports_scores = True

    def forward(self, q, k_cache, v_cache, view, scale, return_scores=False):
        from agentrt_kernels.torch_ref import paged_attention, selected_slots_attention

        if isinstance(view, QuantizedPagesView):
            return quantized_forward(q, view, scale, return_scores)
        if isinstance(view, SelectedSlotsView):
            return selected_slots_attention(
                q, k_cache, v_cache, view.slot_indptr, view.slot_indices, scale,
                query_lens=view.query_lens_cpu, slot_counts=view.kv_lens_cpu, causal=view.causal,
                return_scores=return_scores,
            )
        return paged_attention(
            q, k_cache, v_cache, view.block_tables, view.kv_lens_cpu, view.query_lens_cpu,
            scale, causal=view.causal, return_scores=return_scores,
        )


def quantized_forward(q, view: QuantizedPagesView, scale: float, return_scores: bool = False):
    """The torch reference over a codec's pages (decoded a block of pages at a time)."""
    from agentrt_kernels.torch_ref.quantized_attention import quantized_paged_attention

    if isinstance(view, QuantizedLatentView):
        return latent_quantized_forward(q, view, scale, return_scores)
    codec, d = view.codec, q.shape[-1]
    return quantized_paged_attention(
        q, lambda pages: decode_pages(codec.layer_codec(view.layer, "k"), view.k_fields, pages, d),
        lambda pages: decode_pages(codec.layer_codec(view.layer, "v"), view.v_fields, pages, d),
        view.block_tables, view.page_size, view.kv_lens_cpu, view.quant_lens_cpu, view.query_lens_cpu, scale,
        window_k=view.window_k, window_v=view.window_v, window_ids=view.window_ids_cpu, causal=view.causal,
        return_scores=return_scores,
    )


def latent_quantized_forward(q, view: QuantizedLatentView, scale: float, return_scores: bool = False):
    """The torch reference over coded latent rows: each block of pages is decoded once and read as the keys and
    as the values. The reference's accumulator is as wide as the query (the whole row), so it sums whole rows and
    the output keeps their first ``value_dim`` channels: a softmax-weighted sum is taken channel by channel, so
    this is attention over the values, for ``rope / value_dim`` more multiply-adds and no second decode."""
    from agentrt_kernels.torch_ref.quantized_attention import quantized_paged_attention

    row, d = view.row_codec, q.shape[-1]
    last: list = [None, None]  # (page ids, their rows): the reference asks for a block's keys, then its values

    def decode(pages: torch.Tensor) -> torch.Tensor:
        if last[0] is not pages:
            last[0], last[1] = pages, decode_pages(row, view.k_fields, pages, d)
        return last[1]

    out, scores = quantized_paged_attention(
        q, decode, decode, view.block_tables, view.page_size, view.kv_lens_cpu, view.quant_lens_cpu,
        view.query_lens_cpu, scale, causal=view.causal, return_scores=return_scores)
    return out[..., : view.value_dim].contiguous(), scores


@dataclass(slots=True, frozen=True)
class BackendEntry:
    """A backend by name: its class as ``module:QualName`` (imported when first built, so a CPU engine never
    imports triton), whether it needs a CUDA device, and the package it needs (named in the error)."""

    target: str
    cuda: bool = True
    needs: str | None = None


# every attention backend, by the name ``attention_backend`` takes; a new backend adds its entry
BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("engine.attention_backend:TorchReferenceBackend", cuda=False),
    "triton": BackendEntry("engine.gpu_backends:TritonBackend"),
    "flashinfer": BackendEntry("engine.gpu_backends:FlashInferBackend", needs="flashinfer-python"),
    "triton+flashinfer": BackendEntry("engine.gpu_backends:TritonFlashInferBackend", needs="flashinfer-python"),
}


BACKEND_NAMES = ("auto", *BACKENDS)


def _construct(name: str, device: torch.device) -> AttentionBackend:
    entry = BACKENDS[name]
    if entry.cuda and device.type != "cuda":
        raise ConfigError(f"attention_backend {name!r} needs a CUDA device; the engine runs on {device}")
    module, _, qualname = entry.target.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    try:
        return cls(device)
    except ImportError as exc:
        raise ConfigError(f"attention_backend {name!r} needs {entry.needs} installed: {exc}") from exc


def auto_candidates(device: torch.device, flashinfer_installed: bool) -> list[str]:
    """``auto``'s order of preference, fastest first. On a GPU: Triton with flashinfer's paged prefill when
    flashinfer is installed (its prefill ran 1.3-1.5x ours at 8K-32K on an H200, same run; decode stays on
    Triton's kernels and graphs), then Triton alone; the torch reference last, and alone off a GPU."""
    if device.type != "cuda":
        return ["torch"]
    return (["triton+flashinfer"] if flashinfer_installed else []) + ["triton", "torch"]


def make_backend(
    name: str, device: torch.device, method: SparseMethod, dtype: torch.dtype | None = None,
    codec: KVCodec | None = None, head_dim: int | None = None, value_dim: int | None = None,
) -> AttentionBackend:
    """The backend by name; ``auto`` takes the first of ``auto_candidates`` that serves ``method``."""
    if name != "auto" and name not in BACKENDS:
        raise ConfigError(f"attention_backend must be one of {('auto', *BACKENDS)}, got {name!r}")
    if name != "auto":
        backend = _construct(name, device)
        reasons = backend.unsupported(method, dtype, codec, head_dim, value_dim)
        if reasons:
            raise ConfigError(f"method {method.name!r} cannot run on attention_backend {name!r}: {'; '.join(reasons)}")
        return backend
    import importlib.util

    for candidate in auto_candidates(device, importlib.util.find_spec("flashinfer") is not None):
        try:
            backend = _construct(candidate, device)
        except ConfigError as exc:  # flashinfer present but not importable here
            log.info("attention backend auto: not %s (%s)", candidate, exc)
            continue
        reasons = backend.unsupported(method, dtype, codec, head_dim, value_dim)
        if not reasons:
            break
        log.info("attention backend auto: not %s (%s)", candidate, "; ".join(reasons))
    log.info("attention backend: %s (auto on %s)", backend.name, device)
    return backend
