"""Dense KV: keys and values in the model dtype, one tensor ``[num_layers, 2, num_pages, page_size,
num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch

from agentrt_kernels import ops
from engine.contract.cache import CacheSpec
from engine.contract.storage import KVStorage, TableHandle
from engine.kv_memory import zeroed


def fuse_rotary_store(kv: torch.Tensor) -> bool:
    """Whether ``write_rotated`` runs the fused Triton RoPE + store kernel on this KV tensor: on a GPU (a test
    forces it on the CPU under the Triton interpreter). Otherwise the model's own rotary module runs, then the
    store, so the CPU path is the model's reference computation."""
    return ops.uses_triton(kv)


def fuse_compaction(kv: torch.Tensor) -> bool:
    """Whether a compaction moves every layer's kept slots in two Triton launches (``gather_kept_layers``): on a
    GPU (a test forces it on the CPU under the Triton interpreter)."""
    return ops.uses_triton(kv)


class DenseKV(KVStorage):
    def __init__(self, spec: CacheSpec, num_pages: int):
        super().__init__(spec, num_pages)
        self.kv = zeroed((spec.num_layers, 2, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim),
                         spec.dtype, spec.device)

    def write(self, layer, k, v, slots, positions=None) -> None:
        kv = self.kv[layer]
        ops.store_kv(k, v, kv[0], kv[1], slots)

    def write_rotated(self, layer, q, k, v, slots, positions, rotary, qk_norm=None):
        """On a GPU one kernel applies the norms, rotates q in place and stores rotated k with v (k itself is not
        written back); on the CPU the same steps one by one."""
        if not fuse_rotary_store(self.kv):
            return super().write_rotated(layer, q, k, v, slots, positions, rotary, qk_norm=qk_norm)
        norm = {}
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            assert q_norm.eps == k_norm.eps, (q_norm.eps, k_norm.eps)
            assert q_norm.zero_centered == k_norm.zero_centered, (type(q_norm), type(k_norm))
            norm = dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps,
                        zero_centered=q_norm.zero_centered)
        from agentrt_kernels.triton import rotary_and_store

        kv = self.kv[layer]
        return rotary_and_store(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, kv[0], kv[1], slots,
                                    **norm)

    def write_prefix(self, table: TableHandle, layer, k, v, slots) -> None:
        self.kv[layer, 0].flatten(0, 1)[slots] = k.to(self.kv.dtype)
        self.kv[layer, 1].flatten(0, 1)[slots] = v.to(self.kv.dtype)

    def copy_pages(self, src, dst) -> None:
        self.kv[:, :, dst] = self.kv[:, :, src]

    def gather_kept(self, layer, table, old_slots, keep):
        head_idx = torch.arange(keep.shape[0], device=keep.device)[None, :]
        return (self.kv[layer, 0].flatten(0, 1)[old_slots[keep.T], head_idx],
                self.kv[layer, 1].flatten(0, 1)[old_slots[keep.T], head_idx])

    def scatter_kept(self, layer, table, kept, new_slots) -> None:
        k, v = kept
        n = k.shape[0]
        self.kv[layer, 0].flatten(0, 1)[new_slots[:n]] = k
        self.kv[layer, 1].flatten(0, 1)[new_slots[:n]] = v

    def gather_kept_layers(self, table, old_slots, keep):
        """On a GPU, every layer in one launch where the layers keep as many slots (a uniform budget):
        ``agentrt_kernels/triton/kv_compact.py``; the per-layer torch indexing otherwise."""
        if not fuse_compaction(self.kv) or len({k.shape for k in keep}) != 1:
            return super().gather_kept_layers(table, old_slots, keep)
        from agentrt_kernels.triton import kv_compact

        return kv_compact.gather_kept(self.kv, old_slots, torch.stack(keep))

    def scatter_kept_layers(self, table, kept, new_slots) -> None:
        if not isinstance(kept, torch.Tensor):  # per layer (gather_kept_layers)
            return super().scatter_kept_layers(table, kept, new_slots)
        from agentrt_kernels.triton import kv_compact

        kv_compact.scatter_kept(self.kv, kept, new_slots)

    def layer_kv(self, layer):
        return self.kv[layer, 0], self.kv[layer, 1]

    def all_layer_keys(self):
        """The pool [L, 2, P, ...] as 2 * L * P pages: layer l's key page p is page 2 * P * l + p."""
        return self.kv.view(-1, *self.kv.shape[3:]), 2 * self.kv.shape[2]

    def page_tensors(self):
        return [(self.kv, 2)]
