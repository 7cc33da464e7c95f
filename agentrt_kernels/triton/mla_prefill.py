"""Paged prefill / extend attention for multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash), absorbed
form.

``mla_paged_prefill(q, latent, block_tables, kv_lens, query_start_loc, scale, value_dim, causal=True,
max_query_len=None, out=None, lse=None)``
    q:               [T, Hq, Dk] fp32 / fp16 / bf16 (last dim contiguous; other strides free): the flattened
                     absorbed queries (q_nope W_uk, q_rope) of B requests, Dk = kv_lora_rank + rope_dim (512 + 64)
    latent:          [num_pages, page_size, 1, Dk] or [num_pages, page_size, Dk], q's dtype: ONE cached row per
                     token (c_kv then k_pe), shared by every query head; the new tokens are already in it
    block_tables:    [B, max_pages] int32 page ids; kv_lens: [B] int32, the new tokens included
    query_start_loc: [B + 1] int32 CSR offsets: request b owns q rows query_start_loc[b]:query_start_loc[b+1],
                     which are its LAST q_len slots of kv_lens[b] (a chunk may start mid-context)
    scale:           softmax scale (python float)
    value_dim:       Dv <= Dk: the values are the FIRST Dv channels of each latent row (V is a slice of K)
    causal:          query j of a request with q_len queries sees slots < kv_len - q_len + j + 1 (else all kv_len)
    max_query_len:   host int bound on any request's query length (sizes the grid); None derives it from
                     query_start_loc with a device sync
    out:             optional preallocated [T, Hq, Dv] output (last dim contiguous)
    lse:             optional [T, Hq] fp32 output (last dim contiguous): each row's NATURAL-log log-sum-exp of its
                     visible logits ``q . k * scale`` (-inf for a row that sees nothing). NB: the dense
                     ``prefill_attention`` kernel writes log2-sum-exp of the logits times log2(e); this one is in
                     the natural-log units that merge_attn_states-style consumers use
    returns          out [T, Hq, Dv] in q's dtype

Multi-query attention with one KV head: keys are whole latent rows (Dk channels), values their first Dv channels.
Grid (cdiv(max_query_len, BLOCK_Q) * head_tiles, B). A program owns BLOCK_Q query tokens of one request and a
tile of BLOCK_H query heads, packed as BLOCK_M = next_pow2(BLOCK_Q * BLOCK_H) >= 16 rows of one Q tile (row m =
token m // BLOCK_H, head m % BLOCK_H; BLOCK_H need not be a power of two: GLM-4.7-Flash's 20 heads take tiles of
3 tokens x 20 heads = 60 of 64 rows). The head tiles of one query block are neighbours in the launch order
(axis 0), so their reads of the same latent rows hit L2; query blocks are walked last-first so the blocks with
the most context start first, and blocks past a request's query length exit at once.

Each step gathers BLOCK_N latent rows through the page table (any page size; a tile may span pages) and reads
them once for all BLOCK_M rows and for both products, as in ``mla_decode``: S = Q K^T is two tl.dots, over the
value channels [0, Dv) (the [BLOCK_N, BLOCK_DV] tile) and over the rest [Dv, Dk) (a [BLOCK_N, BLOCK_DR] tile),
each padded to a power of two with masked channels (576 -> 512 + 64, no padding); P V is a tl.dot of the
probabilities with the very same [BLOCK_N, BLOCK_DV] tile. fp16/bf16 dot operands, fp32 accumulation, online
softmax in base 2. The context loop runs in two phases, as ``prefill_attention``'s: the tiles every row sees
whole (no mask), then the diagonal tiles with the causal mask (non-causal: the kv_len tail); tiles past the
block's last visible slot are never read (in the block's last tile, slots past it re-read the last visible
row rather than predicating the gather, and are masked out). Both phases run in one loop with a uniform
per-tile branch: as two loops ptxas needs more registers than the 64 x 32 tile leaves and spills.

Tiles (``launch_config``): at Dv >= 256 (MLA's 512), bf16 / fp16 take BLOCK_M = 64 rows x BLOCK_N = 32 latent
rows, 8 warps (two warpgroups: the [64, 512] fp32 accumulator splits into two [64, 256] halves, 128 registers a
thread), 2 stages; fp32 (FMA dots) 16 x 16. Short batches (max_query_len * heads < 64) shrink BLOCK_M to the
power of two that holds them. Small widths (tests) take 64 x 32, 4 warps. Every knob can be overridden per
call. Figures from ptxas for sm_90a are in ``launch_config``'s docstring.

CUDA-graph safety: with ``max_query_len`` given there are no host syncs (no ``.item()``, no reading kv_lens or
query_start_loc on the host); the grid depends only on max_query_len, B, Hq and the tile choice.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import cdiv, check_last_dim_contiguous, dot_args, next_pow2
from agentrt_kernels.triton.fitting_launch import launch_fitting

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_tile(
    q_v, q_r, acc, m_i, l_i, bt_row, kv_ptr, n0, hi, full_end, row_limit, offs_n, offs_v, offs_r, v_mask, r_mask,
    stride_kp, stride_ks, scale_log2,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, DK: tl.constexpr,
    BLOCK_DR: tl.constexpr, HAS_REST: tl.constexpr, dot_ty: tl.constexpr, PRECISION: tl.constexpr,
):
    """One BLOCK_N-slot step of the online softmax for all BLOCK_M rows."""
    tok = n0 + offs_n
    # Slots past hi (the block's last visible slot, only in its last tile) re-read slot hi - 1 instead of
    # masking the loads: the gather stays unpredicated, nothing past hi is touched, and the mask drops them.
    slot = tl.minimum(tok, hi - 1)
    page = tl.load(bt_row + slot // PAGE_SIZE).to(tl.int64)
    rows = kv_ptr + page * stride_kp + (slot % PAGE_SIZE).to(tl.int64) * stride_ks  # [BLOCK_N] row starts
    # the value channels: K's first DV channels and all of V, read once for both products
    if DV == BLOCK_DV:
        kv = tl.load(rows[:, None] + offs_v[None, :])
    else:
        kv = tl.load(rows[:, None] + offs_v[None, :], mask=v_mask[None, :], other=0.0)
    kv = kv.to(dot_ty)
    qk = tl.dot(q_v, tl.trans(kv), input_precision=PRECISION)
    if HAS_REST:
        if DK - DV == BLOCK_DR:
            kr = tl.load(rows[:, None] + offs_r[None, :])
        else:
            kr = tl.load(rows[:, None] + offs_r[None, :], mask=r_mask[None, :], other=0.0)
        qk += tl.dot(q_r, tl.trans(kr.to(dot_ty)), input_precision=PRECISION)
    qk = qk * scale_log2
    if n0 + BLOCK_N > full_end:  # a diagonal (causal) or tail tile: some rows do not see every slot
        qk = tl.where(tok[None, :] < row_limit[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), kv, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr, kv_ptr, o_ptr, bt_ptr, lens_ptr, qsl_ptr, lse_ptr,
    scale_log2, num_heads,
    stride_qt, stride_qh,
    stride_kp, stride_ks,
    stride_btb,
    stride_ot, stride_oh,
    stride_lt,
    HEAD_TILES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, DK: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_REST: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    ht = pid % HEAD_TILES
    qb = tl.num_programs(0) // HEAD_TILES - 1 - pid // HEAD_TILES  # last query block first
    b = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = qb * BLOCK_Q
    if q0 >= q_len:
        return
    kv_len = tl.load(lens_ptr + b)
    ctx = kv_len - q_len  # slots before the request's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, BLOCK_DV)  # value channels [0, DV)
    offs_r = DV + tl.arange(0, BLOCK_DR)  # the rest of the key [DV, DK) (the rope part)
    offs_n = tl.arange(0, BLOCK_N)
    tok_q = q0 + offs_m // BLOCK_H
    head = ht * BLOCK_H + offs_m % BLOCK_H
    row_mask = (offs_m < BLOCK_Q * BLOCK_H) & (tok_q < q_len) & (head < num_heads)
    v_mask = offs_v < DV
    r_mask = offs_r < DK

    dot_ty = tl.float32 if UPCAST else kv_ptr.dtype.element_ty
    q_ptrs = q_ptr + (q_start + tok_q).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_v = tl.load(q_ptrs + offs_v[None, :], mask=row_mask[:, None] & v_mask[None, :], other=0.0).to(dot_ty)
    if HAS_REST:
        q_r = tl.load(q_ptrs + offs_r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(dot_ty)
    else:
        q_r = q_v  # unused

    if CAUSAL:
        hi = ctx + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the last slot any row of the block sees
        full_end = ((ctx + q0 + 1) // BLOCK_N) * BLOCK_N  # tiles below this are visible to every row
        row_limit = tl.minimum(ctx + tok_q + 1, hi)
    else:
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N
        row_limit = tl.full([BLOCK_M], 0, dtype=tl.int32) + kv_len

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    # Tiles [0, full_end) unmasked, then the diagonal tiles [full_end, hi) with the causal mask. One loop with
    # a uniform per-tile branch rather than two loops: at Dk = 576 two loops cost ptxas ~10-20 registers more
    # and spill at BLOCK_N = 32 (see launch_config).
    for n0 in range(0, hi, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            q_v, q_r, acc, m_i, l_i, bt_row, kv_ptr, n0, hi, full_end, row_limit, offs_n, offs_v, offs_r,
            v_mask, r_mask, stride_kp, stride_ks, scale_log2,
            BLOCK_N, PAGE_SIZE, DV, BLOCK_DV, DK, BLOCK_DR, HAS_REST, dot_ty, PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    # The store's row indices, recomputed from an opaque zero (a re-read of query_start_loc[b]) rather than
    # kept live across the loop: with 20 heads a tile (m // 20, m % 20) keeping them spills at 64 x 32 tiles.
    offs_m = tl.arange(0, BLOCK_M) + (tl.load(qsl_ptr + b, volatile=True) - q_start)
    tok_q = q0 + offs_m // BLOCK_H
    head = ht * BLOCK_H + offs_m % BLOCK_H
    row_mask = (offs_m < BLOCK_Q * BLOCK_H) & (tok_q < q_len) & (head < num_heads)
    q_rows = (q_start + tok_q).to(tl.int64)
    o_ptrs = o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & v_mask[None, :])
    if STORE_LSE:  # natural log of sum(exp(q . k * scale)) over the visible slots
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + q_rows * stride_lt + head, lse, mask=row_mask)


def launch_config(num_heads: int, max_query_len: int, block_dv: int, dtype: torch.dtype,
                  block_m: int | None = None) -> dict:
    """Tile choice: {BLOCK_H, BLOCK_Q, BLOCK_M, HEAD_TILES, BLOCK_N, num_warps, num_stages}.

    Rows: up to ``block_m`` (default 64; 16 for fp32 at MLA widths) token x head pairs. Hq above that splits into
    the fewest balanced head tiles (128 -> 2 x 64, one token a program); Hq at most that is one head tile of all
    heads and block_m // Hq tokens (16 -> 4 x 16, 20 -> 3 x 20 in 64 rows). Short batches (max_query_len tokens of
    every head fit in fewer rows) shrink BLOCK_M to the power of two >= 16 that holds them.

    At Dv >= 256 (MLA's 512 + 64), as ptxas (Triton 3.6, sm_90a, ``benchmarks.kernel_resources.compile_sm90``,
    page 64, causal, lse on) compiles them: bf16 / fp16 64 rows x 32 latent rows, 8 warps, 2 stages: wgmma, the
    [64, 512] fp32 accumulator in two warpgroups' [64, 256] halves, 255 registers and no spills, 148 KiB of
    shared memory (Q tile and a double-buffered cp.async latent tile), one program a SM, 16, 20 and 128 heads
    alike. 32 latent rows a step amortise the accumulator's rescale (128 FMULs a thread a step) over twice the
    slots of 16 (~30 vs ~50 SASS instructions a slot in the main loop); 64 also compiles (224 KiB) but leaves no
    shared-memory headroom. 32-row tiles (short batches) take 173 registers (mma.sync), 16-row 98 (two programs
    a SM). fp32 (FMA dots) 16 x 16, 8 warps, 104 registers. Chosen from those figures; not yet timed on a GPU."""
    big = block_dv >= 256
    if block_m is None:
        block_m = 16 if (big and dtype == torch.float32) else 64
    block_m = max(16, next_pow2(block_m))
    if num_heads > block_m:
        head_tiles = cdiv(num_heads, block_m)
        block_h = cdiv(num_heads, head_tiles)
        block_q = 1
    else:
        head_tiles, block_h = 1, num_heads
        block_q = max(1, block_m // num_heads)
    block_q = max(1, min(block_q, max_query_len))
    rows = max(16, next_pow2(block_q * block_h))
    if big:
        block_n, warps, stages = (16 if dtype == torch.float32 else 32), 8, 2
    else:
        block_n, warps, stages = 32, 4, 2
    return dict(BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=rows, HEAD_TILES=head_tiles, BLOCK_N=block_n,
                num_warps=warps, num_stages=stages)


def mla_paged_prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    value_dim: int,
    causal: bool = True,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Flash attention of the flattened queries q [T, Hq, Dk] over each request's paged latent rows (keys: the
    whole row, values: its first ``value_dim`` channels) -> [T, Hq, value_dim]."""
    num_tokens, num_heads, dk = q.shape
    if latent.dim() == 4:
        assert latent.shape[2] == 1, f"MLA latent cache has one KV head, got {tuple(latent.shape)}"
        latent = latent[:, :, 0]
    assert latent.dim() == 3 and latent.shape[2] == dk, (q.shape, latent.shape)
    page_size = latent.shape[1]
    dv = int(value_dim)
    assert 0 < dv <= dk, (value_dim, dk)
    assert latent.dtype == q.dtype, (q.dtype, latent.dtype)
    batch = block_tables.shape[0]
    assert kv_lens.shape == (batch,) and query_start_loc.shape == (batch + 1,), (
        block_tables.shape, kv_lens.shape, query_start_loc.shape)
    for name, t in (("q", q), ("latent", latent), ("block_tables", block_tables), ("kv_lens", kv_lens),
                    ("query_start_loc", query_start_loc)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty((num_tokens, num_heads, dv), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (num_tokens, num_heads, dv) and out.dtype == q.dtype, (out.shape, out.dtype)
        check_last_dim_contiguous("out", out)
    if lse is not None:
        assert lse.shape == (num_tokens, num_heads) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
        check_last_dim_contiguous("lse", lse)
    if max_query_len is None:  # convenience only: this reads the device (a sync); engines pass it
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if batch else 0
    if num_tokens == 0 or num_heads == 0 or batch == 0 or max_query_len <= 0:
        return out

    block_dv = next_pow2(dv)
    block_dr = max(16, next_pow2(dk - dv))
    cfg = launch_config(num_heads, max_query_len, block_dv, q.dtype, block_m)
    block_n = block_n or cfg["BLOCK_N"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    head_tiles = cfg["HEAD_TILES"]
    upcast, precision = dot_args(_mla_prefill_kernel, q.dtype)
    grid = (math.ceil(max_query_len / cfg["BLOCK_Q"]) * head_tiles, batch)

    def launch(rows_a_tile: int, stages: int) -> None:
        _mla_prefill_kernel[grid](
            q, latent, out, block_tables, kv_lens, query_start_loc, out if lse is None else lse,
            scale * _LOG2E, num_heads,
            q.stride(0), q.stride(1),
            latent.stride(0), latent.stride(1),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            0 if lse is None else lse.stride(0),
            HEAD_TILES=head_tiles, BLOCK_H=cfg["BLOCK_H"], BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=rows_a_tile, DV=dv, BLOCK_DV=block_dv, DK=dk, BLOCK_DR=block_dr, HAS_REST=dk > dv,
            PAGE_SIZE=page_size, CAUSAL=bool(causal),
            UPCAST=upcast, PRECISION=precision, STORE_LSE=lse is not None,
            num_warps=num_warps, num_stages=stages,
        )

    # GPUs with less shared memory a block than Hopper's take fewer stages or latent rows a tile
    launch_fitting(launch, q.device.index, ("mla_prefill", cfg["BLOCK_M"], head_tiles, num_warps, q.dtype, dk, dv,
                                            bool(causal)), block_n, num_stages)
    return out
