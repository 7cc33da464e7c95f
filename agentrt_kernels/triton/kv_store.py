"""Scatter new K/V rows into a paged KV cache.

``store_kv(k, v, k_cache, v_cache, slot_mapping)``
    k, v:          [T, Hkv, D] (any float dtype; strided views such as slices of a packed qkv are fine as
                   long as the last dim is contiguous)
    k_cache/v_cache: [num_pages, page_size, Hkv, D] (the cache dtype; values are cast on store)
    slot_mapping:  [T] int64, slot = page * page_size + offset; slots < 0 are skipped (the padding
                   sentinel of CUDA-graph batches)

One program per token copies that token's [Hkv, D] K and V tiles (one 2-D block each, 16-byte vector
accesses along D). Memory-bound: it reads and writes each element once. No host syncs; launch shape is
[T] only, so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch,
    stride_vcp, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)

    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)

    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k[t], v[t] ([Hkv, D] each) to slot ``slot_mapping[t]`` of k_cache/v_cache; skip slots < 0."""
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_heads, head_dim), k_cache.shape
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    block_h, block_d = next_pow2(num_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)), PDL=(on := pdl(k.device)), launch_pdl=on,
    )
