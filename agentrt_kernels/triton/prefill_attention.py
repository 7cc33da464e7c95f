"""Paged prefill / extend attention (flash-attention tiling over a paged KV cache).

``paged_prefill_attention(q, k_cache, v_cache, block_tables, kv_lens, query_start_loc, scale, causal=True,
max_query_len=...)``
    q:               [T, Hq, D] fp32 / fp16 / bf16, the flattened queries of B requests (last dim contiguous)
    k_cache/v_cache: [num_pages, page_size, Hkv, D], same dtype; Hq % Hkv == 0
    block_tables:    [B, max_pages] int32; kv_lens: [B] int32, new tokens included (already in the cache)
    query_start_loc: [B + 1] int32 CSR offsets; request b owns rows query_start_loc[b]:query_start_loc[b+1]
    scale:           softmax scale; causal: query j of a request with q_len queries sees slots
                     < kv_len - q_len + j + 1 (else all kv_len slots)
    max_query_len:   host int bound on any request's query length (sizes the grid); None derives it from
                     query_start_loc with a device sync
    returns          out [T, Hq, D] in q's dtype

Grid (cdiv(max_query_len, BLOCK_Q), B, Hkv). A program owns BLOCK_Q query tokens of one request and all
GROUP = Hq / Hkv query heads of one KV head, packed as BLOCK_M = BLOCK_Q * GROUP (padded to a power of
two) rows of one Q tile (row m = token m // GROUP, head m % GROUP), so each K/V tile gathered from the
pages feeds every head of the group. The loop over BLOCK_N-token KV tiles runs in two phases: tiles every
row may see completely (no mask at all), then the diagonal tiles with the causal mask; tiles past the
tile's last visible slot are never read. S = Q K^T and P V use tl.dot (fp16/bf16 operands, fp32
accumulation), with an online softmax in base 2. Query blocks are walked last-first so the longest
(most KV) blocks start first; blocks past a request's query length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2
from agentrt_kernels.triton.fitting_launch import launch_fitting

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_tile(
    q, acc, m_i, l_i, k_head, v_head, bt_row, n0, hi, row_limit, offs_n, offs_d, d_mask,
    stride_kp, stride_ks, stride_vp, stride_vs, scale_log2,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, dot_ty: tl.constexpr, PRECISION: tl.constexpr,
):
    tok = n0 + offs_n
    if MASKED:
        n_mask = tok < hi
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(bt_row + tok // PAGE_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    in_page = (tok % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_head + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=PRECISION) * scale_log2
    if MASKED:
        qk = tl.where(tok[None, :] < row_limit[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, lens_ptr, qsl_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
):
    qb = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = qb * BLOCK_Q
    if q0 >= q_len:
        return
    kv_len = tl.load(lens_ptr + b)
    ctx = kv_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok_q = q0 + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok_q < q_len)
    d_mask = offs_d < HEAD_DIM

    dot_ty = tl.float32 if UPCAST else k_ptr.dtype.element_ty
    q_rows = (q_start + tok_q).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(dot_ty)

    if CAUSAL:
        hi = ctx + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the last slot any row of the tile sees
        full_end = ((ctx + q0 + 1) // BLOCK_N) * BLOCK_N  # tiles below this are visible to every row
        row_limit = tl.minimum(ctx + tok_q + 1, hi)
    else:
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N
        row_limit = tl.full([BLOCK_M], 0, dtype=tl.int32) + kv_len

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            q, acc, m_i, l_i, k_head, v_head, bt_row, n0, hi, row_limit, offs_n, offs_d, d_mask,
            stride_kp, stride_ks, stride_vp, stride_vs, scale_log2,
            PAGE_SIZE, False, dot_ty, PRECISION)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            q, acc, m_i, l_i, k_head, v_head, bt_row, n0, hi, row_limit, offs_n, offs_d, d_mask,
            stride_kp, stride_ks, stride_vp, stride_vs, scale_log2,
            PAGE_SIZE, True, dot_ty, PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptrs = o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    if STORE_LSE:  # [T, Hq] fp32, log2 domain, of the scaled logits
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + q_rows * tl.num_programs(2) * GROUP + head, lse, mask=row_mask)


def _default_blocks(block_d: int, max_kv_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for an H100/H200-class GPU.

    Measured on an H200 (bf16, Hq/Hkv = 32/8, D = 128, causal): 128x128 tiles, 8 warps, 3 stages win for
    long KV (a 4096-token prefill, over 128x64); 128x64 for short KV (<= 512 tokens).
    """
    if block_d <= 64:
        return 128, 64, 4, 3
    if block_d <= 128:
        return (128, 128, 8, 3) if max_kv_len >= 1024 else (128, 64, 8, 3)
    return 64, 32, 4, 2


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    *,
    lse: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Flash attention of the flattened queries q [T, Hq, D] over each request's paged KV -> [T, Hq, D].
    With ``lse`` (a contiguous [T, Hq] fp32 tensor) each row's log2-sum-exp of ``q . k * scale * log2(e)`` is
    written there too (what a second pass needs to recompute probabilities tile by tile)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kd = k_cache.shape
    batch = block_tables.shape[0]
    assert kd == head_dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert kv_lens.shape == (batch,) and query_start_loc.shape == (batch + 1,), (kv_lens.shape, query_start_loc.shape)
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    if max_query_len is None:  # convenience only: this reads the device (a sync); engines pass it
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if batch else 0
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("kv_lens", kv_lens), ("query_start_loc", query_start_loc)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == q.shape, (out.shape, q.shape)
        check_last_dim_contiguous("out", out)
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out

    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    d_block_m, d_block_n, d_warps, d_stages = _default_blocks(block_d, block_tables.shape[1] * page_size)
    block_n = block_n or d_block_n
    block_m = block_m or d_block_m
    num_stages = num_stages or d_stages
    # Small requests (decode-like extends) do not need 128-row tiles.
    block_m = min(block_m, max(16, next_pow2(max_query_len * group)))
    block_m = max(block_m, next_pow2(group), 16)
    block_q = block_m // group
    num_warps = num_warps or (d_warps if block_m >= 64 else 4)
    upcast, precision = dot_args(_prefill_kernel, q.dtype)
    grid = (triton.cdiv(max_query_len, block_q), batch, num_kv_heads)

    def launch(keys_a_tile: int, stages: int) -> None:
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, kv_lens, query_start_loc, out if lse is None else lse,
            scale * _LOG2E,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=keys_a_tile,
            HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page_size, CAUSAL=causal,
            UPCAST=upcast, PRECISION=precision, STORE_LSE=lse is not None,
            num_warps=num_warps, num_stages=stages,
        )

    # GPUs with less shared memory a block than Hopper's take fewer stages or keys a tile
    launch_fitting(launch, q.device.index, ("prefill", block_m, num_warps, q.dtype, head_dim, causal), block_n,
                   num_stages)
    return out
