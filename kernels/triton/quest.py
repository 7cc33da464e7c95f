"""Quest page scores on the GPU: the upper bound ``sum_d max(q_d min_d, q_d max_d)`` of every listed page.

``quest_page_scores(q, kmin, kmax, pages, aggregate)``
    q:          [S, Hq, D] (one decode query per row; last dim contiguous)
    kmin/kmax:  [num_pages, Hkv, D] per-page key bounds of one layer (any float dtype; math in fp32)
    pages:      [S, W] int page ids per row, in logical order (entries past a row's pages may be anything
                valid; the caller masks them)
    aggregate:  "max" or "sum" over all query heads
    returns     [S, W] fp32

Grid (S, Hkv, cdiv(W, BLOCK_P)): one program reads the bounds of BLOCK_P pages of one KV head once and
scores them for every query head of the group, reducing over the group; the per-KV-head partials
([S, Hkv, W], small) are reduced over KV heads by torch. Reads 2 * W * Hkv * D bound values per row, the
same bytes as the reference's gather, without materialising the repeated [S, W, Hq, D] products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import cdiv, check_last_dim_contiguous, next_pow2

AGGREGATES = ("max", "sum")


@triton.jit
def _quest_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, pages_ptr, out_ptr,
    stride_qs, stride_qh,
    stride_bp, stride_bh,
    stride_ps,
    stride_os, stride_oh,
    width,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_MAX: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < width
    d_mask = offs_d < HEAD_DIM
    page = tl.load(pages_ptr + s.to(tl.int64) * stride_ps + offs_p, mask=p_mask, other=0).to(tl.int64)
    bounds = (page * stride_bp + kvh * stride_bh)[:, None] + offs_d[None, :]
    mask = p_mask[:, None] & d_mask[None, :]
    lo = tl.load(kmin_ptr + bounds, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(kmax_ptr + bounds, mask=mask, other=0.0).to(tl.float32)
    if USE_MAX:
        agg = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    else:
        agg = tl.zeros([BLOCK_P], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        qg = tl.load(q_ptr + s.to(tl.int64) * stride_qs + (kvh * GROUP + g) * stride_qh + offs_d,
                     mask=d_mask, other=0.0).to(tl.float32)
        score = tl.sum(tl.maximum(qg[None, :] * lo, qg[None, :] * hi), 1)
        if USE_MAX:
            agg = tl.maximum(agg, score)
        else:
            agg = agg + score
    tl.store(out_ptr + s.to(tl.int64) * stride_os + kvh * stride_oh + offs_p, agg, mask=p_mask)


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                      aggregate: str = "max", block_p: int = 32) -> torch.Tensor:
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    for name, t in (("q", q), ("kmin", kmin), ("kmax", kmax), ("pages", pages)):
        check_last_dim_contiguous(name, t)
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    width = pages.shape[1]
    partial = torch.empty(rows, num_kv_heads, width, dtype=torch.float32, device=q.device)
    if rows and width:
        _quest_scores_kernel[(rows, num_kv_heads, cdiv(width, block_p))](
            q, kmin, kmax, pages, partial,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), pages.stride(0),
            partial.stride(0), partial.stride(1), width,
            GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
            BLOCK_P=block_p, USE_MAX=aggregate == "max",
        )
    return partial.amax(dim=1) if aggregate == "max" else partial.sum(dim=1)
