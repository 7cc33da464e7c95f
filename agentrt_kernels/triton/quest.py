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

from agentrt_kernels.triton._common import cdiv, check_last_dim_contiguous, next_pow2

AGGREGATES = ("max", "sum")


@triton.jit
def _aggregate_group(agg, q_row_ptr, kvh, lo, hi, stride_qh, offs_d, d_mask, GROUP: tl.constexpr,
                     USE_MAX: tl.constexpr):
    """``agg`` [P] combined (max or sum) with the upper bound of each query head of KV head ``kvh``'s group
    over pages with bounds ``lo``/``hi`` [P, D] (fp32)."""
    for g in tl.static_range(GROUP):
        qg = tl.load(q_row_ptr + (kvh * GROUP + g) * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        score = tl.sum(tl.maximum(qg[None, :] * lo, qg[None, :] * hi), 1)
        if USE_MAX:
            agg = tl.maximum(agg, score)
        else:
            agg = agg + score
    return agg


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
    agg = _aggregate_group(agg, q_ptr + s.to(tl.int64) * stride_qs, kvh, lo, hi, stride_qh, offs_d, d_mask,
                           GROUP, USE_MAX)
    tl.store(out_ptr + s.to(tl.int64) * stride_os + kvh * stride_oh + offs_p, agg, mask=p_mask)


def pages_per_program(head_dim: int) -> int:
    """Pages one program scores: its [BLOCK_P, BLOCK_D] fp32 bounds (two of them) stay in registers, 4096
    values each -- 32 pages of a 128-channel head, 4 of a 576-channel latent (padded to 1024), where 32 pages
    would spill most of the bounds to local memory."""
    return max(1, min(32, 4096 // max(16, next_pow2(head_dim))))


def _check_scoring_args(q: torch.Tensor, kmin: torch.Tensor, aggregate: str, **tensors: torch.Tensor) -> int:
    """Validates a scoring call (``aggregate``, contiguous last dims, GQA head counts); returns the group."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    for name, t in (("q", q), ("kmin", kmin), *tensors.items()):
        check_last_dim_contiguous(name, t)
    num_q_heads, num_kv_heads = q.shape[1], kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                      aggregate: str = "max", block_p: int | None = None) -> torch.Tensor:
    group = _check_scoring_args(q, kmin, aggregate, kmax=kmax, pages=pages)
    rows, _, head_dim = q.shape
    block_p = block_p or pages_per_program(head_dim)
    num_kv_heads = kmin.shape[1]
    width = pages.shape[1]
    partial = torch.empty(rows, num_kv_heads, width, dtype=torch.float32, device=q.device)
    if rows and width:
        _quest_scores_kernel[(rows, num_kv_heads, cdiv(width, block_p))](
            q, kmin, kmax, pages, partial,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), pages.stride(0),
            partial.stride(0), partial.stride(1), width,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
            BLOCK_P=block_p, USE_MAX=aggregate == "max",
        )
    return partial.amax(dim=1) if aggregate == "max" else partial.sum(dim=1)


# --- a pure-decode step's whole selection in two launches (around a torch top-k) -----------------------------
@triton.jit
def _quest_decode_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, k_ptr, bt_ptr, lens_ptr, out_ptr,
    stride_qs, stride_qh,
    stride_bp, stride_bh,
    stride_kp, stride_ks, stride_kh,
    stride_bts, stride_os,
    width, num_kv_heads,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, USE_MAX: tl.constexpr,
):
    """Row s, pages [tile * BLOCK_P, +BLOCK_P) of its table: the new key (the row's last slot) widens its
    page's bounds (tile 0, every KV head), and every page before the last is scored over all query heads;
    the last page and the columns past it score -inf. The last page is never scored, so the programs that
    score need not wait for the one that updates it (a request's last page is its own: copy on write)."""
    s = tl.program_id(0)
    tile = tl.program_id(1)
    offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    n = tl.load(lens_ptr + s)
    last = (n - 1) // PAGE_SIZE
    bt_row = bt_ptr + s.to(tl.int64) * stride_bts
    if tile == 0:
        last_page = tl.load(bt_row + last).to(tl.int64)
        offset = n - 1 - last * PAGE_SIZE
        for h in range(0, num_kv_heads):
            k_new = tl.load(k_ptr + last_page * stride_kp + offset * stride_ks + h * stride_kh + offs_d,
                            mask=d_mask, other=0.0)
            bound = kmin_ptr + last_page * stride_bp + h * stride_bh + offs_d
            lo = tl.load(bound, mask=d_mask, other=0.0)
            hi = tl.load(kmax_ptr + last_page * stride_bp + h * stride_bh + offs_d, mask=d_mask, other=0.0)
            fresh = offset == 0  # a page's first slot resets its bounds
            tl.store(bound, tl.where(fresh, k_new, tl.minimum(lo, k_new)), mask=d_mask)
            tl.store(kmax_ptr + last_page * stride_bp + h * stride_bh + offs_d,
                     tl.where(fresh, k_new, tl.maximum(hi, k_new)), mask=d_mask)
    candidate = offs_p < last
    page = tl.load(bt_row + offs_p, mask=candidate, other=0).to(tl.int64)
    mask = candidate[:, None] & d_mask[None, :]
    if USE_MAX:
        agg = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    else:
        agg = tl.zeros([BLOCK_P], dtype=tl.float32)
    for h in range(0, num_kv_heads):
        bounds = (page * stride_bp + h * stride_bh)[:, None] + offs_d[None, :]
        lo = tl.load(kmin_ptr + bounds, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(kmax_ptr + bounds, mask=mask, other=0.0).to(tl.float32)
        agg = _aggregate_group(agg, q_ptr + s.to(tl.int64) * stride_qs, h, lo, hi, stride_qh, offs_d, d_mask,
                               GROUP, USE_MAX)
    agg = tl.where(candidate, agg, float("-inf"))
    tl.store(out_ptr + s.to(tl.int64) * stride_os + offs_p, agg, mask=offs_p < width)


def quest_decode_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int, aggregate: str = "max",
                        block_p: int | None = None) -> torch.Tensor:
    """One decode query per row ``q`` [B, Hq, D] whose key was just written at slot ``kv_lens - 1``: widens
    that slot's page bounds in ``kmin``/``kmax`` [num_pages, Hkv, D] in place from ``k_cache`` [num_pages,
    page_size, Hkv, D] and returns [B, W] fp32 scores of every column of ``block_tables`` [B, W] before the
    row's last page (the rest -inf), aggregated over all query heads."""
    group = _check_scoring_args(q, kmin, aggregate, kmax=kmax, k_cache=k_cache, block_tables=block_tables)
    rows, _, head_dim = q.shape
    block_p = block_p or pages_per_program(head_dim)
    num_kv_heads = kmin.shape[1]
    width = block_tables.shape[1]
    out = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    if rows and width:
        _quest_decode_scores_kernel[(rows, cdiv(width, block_p))](
            q, kmin, kmax, k_cache, block_tables, kv_lens, out,
            q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
            width, num_kv_heads,
            PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_P=block_p, USE_MAX=aggregate == "max",
        )
    return out


@triton.jit
def _quest_decode_table_kernel(
    val_ptr, idx_ptr, bt_ptr, lens_ptr, out_bt_ptr, out_lens_ptr,
    stride_vs, stride_is, stride_bts, stride_obs,
    width, k, budget, max_kept,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Row s: of the top-k columns (values, indices), the first ``per_row`` with a finite score are kept, in
    increasing column order, then the last page; the row's selected page ids [k + 1] (0 past them) and the
    slots they hold."""
    s = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    n = tl.load(lens_ptr + s)
    last = (n - 1) // PAGE_SIZE
    per_row = tl.where(n <= budget, last, tl.minimum(last, max_kept))
    in_top = j < k
    val = tl.load(val_ptr + s.to(tl.int64) * stride_vs + j, mask=in_top, other=float("-inf"))
    idx = tl.load(idx_ptr + s.to(tl.int64) * stride_is + j, mask=in_top, other=0).to(tl.int32)
    kept = in_top & (j < per_row) & (val > float("-inf"))
    key = tl.where(kept, idx, tl.where(in_top, width + idx, 2 * width + j))  # kept ones first, in column order
    key = tl.sort(key)
    count = tl.sum(kept.to(tl.int32), 0)
    col = tl.where(j == count, last, tl.where(key >= width, 0, key))
    bt_row = bt_ptr + s.to(tl.int64) * stride_bts
    page = tl.load(bt_row + col, mask=j <= k, other=0)
    tl.store(out_bt_ptr + s.to(tl.int64) * stride_obs + j, page, mask=j <= k)
    tl.store(out_lens_ptr + s, (count * PAGE_SIZE + n - last * PAGE_SIZE).to(out_lens_ptr.dtype.element_ty))


def quest_decode_table(top_values: torch.Tensor, top_indices: torch.Tensor, block_tables: torch.Tensor,
                       kv_lens: torch.Tensor, page_size: int, token_budget: int, max_kept: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """From a row's top-k page scores (``top_values``/``top_indices`` [B, k], k >= 0) over the columns of
    ``block_tables`` [B, W]: the selected table [B, k + 1] (kept pages in column order, then the last page,
    then 0) and its lengths [B] in ``kv_lens``' dtype. A row keeps ``last`` pages when it has at most
    ``token_budget`` slots, else at most ``max_kept``; -inf scores are never kept."""
    rows, k = top_indices.shape
    for name, t in (("top_values", top_values), ("top_indices", top_indices), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    out_bt = torch.empty(rows, k + 1, dtype=block_tables.dtype, device=block_tables.device)
    out_lens = torch.empty_like(kv_lens)
    if rows:
        _quest_decode_table_kernel[(rows,)](
            top_values, top_indices, block_tables, kv_lens, out_bt, out_lens,
            top_values.stride(0), top_indices.stride(0), block_tables.stride(0), out_bt.stride(0),
            block_tables.shape[1], k, token_budget, max_kept,
            PAGE_SIZE=page_size, BLOCK=max(2, next_pow2(k + 1)),
        )
    return out_bt, out_lens
