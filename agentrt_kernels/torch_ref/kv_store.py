"""Reference paged-KV store: what ``agentrt_kernels.triton.kv_store`` does in one kernel."""

import torch


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k[t], v[t] ([Hkv, D] each, cast to the cache dtype) to slot ``slot_mapping[t]`` (page * page_size
    + offset) of k_cache/v_cache [num_pages, page_size, Hkv, D]. Every slot must be valid: padding slots (< 0)
    come only from CUDA-graph batches, which the Triton kernel skips."""
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(flat_shape).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
