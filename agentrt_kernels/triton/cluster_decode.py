"""Decode attention of one request over the members of chosen key clusters plus a recent range (RetroInfer's
exact part), reading only those slots of the paged cache.

``cluster_decode_partials(q, k_cache, v_cache, block_table, members, offsets, selected, recent_start, kv_len,
scale, num_splits=4)``
    q:              [Hq, D] one decode query per head (fp32 / fp16 / bf16)
    k/v_cache:      [num_pages, page_size, Hkv, D] the layer's paged cache
    block_table:    [max_pages] int32, the request's pages
    members:        [Hkv, m] int32 logical slots grouped by cluster: cluster ``c`` of head ``h`` is
                    ``members[h, offsets[h, c]:offsets[h, c + 1]]``
    offsets:        [Hkv, C + 1] int32
    selected:       [Hkv, X] int32 the clusters to attend per head (any order; each once)
    recent_start, kv_len: slots ``[recent_start, kv_len)`` are attended by every head
    returns         (o [Hq, S, D] fp32, each split's normalised partial output; lse [Hq, S] fp32 natural-log
                    log-sum-exp of each split's scaled logits, -inf for a split that saw no slot)

Grid (Hkv, S): split ``s`` takes the selected clusters ``s, s + S, ...`` (a cluster's members in tiles of
BLOCK_N) and the recent tiles ``s, s + S, ...``; one program owns the KV head's query-head group. The caller
merges the splits (and anything else, such as estimated clusters) by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2
from agentrt_kernels.triton.quant_decode import _online_update

_LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, k_ptr, v_ptr, bt_ptr, logical, n_mask, kvh, offs_d, d_mask, m_i, l_i, acc, scale_log2,
          s_kp, s_ks, s_kh, PAGE_SIZE: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
    page = tl.load(bt_ptr + logical // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = (page * s_kp + (logical % PAGE_SIZE).to(tl.int64) * s_ks + kvh * s_kh)[:, None] + offs_d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + row, mask=mask, other=0.0).to(DOT_TY)
    v = tl.load(v_ptr + row, mask=mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    return _online_update(qk, v, n_mask, m_i, l_i, acc, DOT_TY, PRECISION)


@triton.jit
def _cluster_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, mem_ptr, off_ptr, sel_ptr, o_ptr, lse_ptr,
    recent_start, kv_len, num_selected, scale_log2,
    stride_qh, s_kp, s_ks, s_kh, s_mh, s_oh, s_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q = tl.load(q_ptr + head[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                other=0.0).to(dot_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for j in range(split, num_selected, NUM_SPLITS):
        cluster = tl.load(sel_ptr + kvh * s_sh + j)
        lo = tl.load(off_ptr + kvh * s_oh + cluster)
        hi = tl.load(off_ptr + kvh * s_oh + cluster + 1)
        for n0 in range(lo, hi, BLOCK_N):
            idx = n0 + offs_n
            n_mask = idx < hi
            logical = tl.load(mem_ptr + kvh * s_mh + idx, mask=n_mask, other=0)
            acc, m_i, l_i = _tile(q, k_ptr, v_ptr, bt_ptr, logical, n_mask, kvh, offs_d, d_mask, m_i, l_i, acc,
                                  scale_log2, s_kp, s_ks, s_kh, PAGE_SIZE, dot_ty, PRECISION)
    for n0 in range(recent_start + split * BLOCK_N, kv_len, NUM_SPLITS * BLOCK_N):
        logical = n0 + offs_n
        n_mask = logical < kv_len
        acc, m_i, l_i = _tile(q, k_ptr, v_ptr, bt_ptr, logical, n_mask, kvh, offs_d, d_mask, m_i, l_i, acc,
                              scale_log2, s_kp, s_ks, s_kh, PAGE_SIZE, dot_ty, PRECISION)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    row = head * NUM_SPLITS + split
    tl.store(o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
             mask=g_mask[:, None] & d_mask[None, :])
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + row, lse, mask=g_mask)


def cluster_decode_partials(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    members: torch.Tensor, offsets: torch.Tensor, selected: torch.Tensor, recent_start: int, kv_len: int,
    scale: float, num_splits: int = 4, *, block_n: int = 16, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert members.shape[0] == offsets.shape[0] == selected.shape[0] == num_kv_heads
    for name, t in (("q", q), ("k_cache", k_cache), ("members", members), ("offsets", offsets),
                    ("selected", selected)):
        check_last_dim_contiguous(name, t)
    group = num_q_heads // num_kv_heads
    o = torch.empty((num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    kernel = _cluster_decode_kernel
    upcast, precision = dot_args(kernel, q.dtype)
    kernel[(num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, members, offsets, selected, o, lse,
        int(recent_start), int(kv_len), selected.shape[1], scale * _LOG2E,
        q.stride(0), *k_cache.stride()[:3], members.stride(0), offsets.stride(0), selected.stride(0),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n, NUM_SPLITS=num_splits, UPCAST=upcast, PRECISION=precision,
        num_warps=num_warps)
    return o, lse
