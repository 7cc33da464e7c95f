"""Received attention on the GPU without materialising probabilities: per request, KV head and slot, the
attention the slot receives summed (``reduce="sum"``) or maximised (``"max"``) over the request's queries and
the KV head's query heads.

``paged_lse(q, k_cache, block_tables, kv_lens, query_start_loc, scale, width, max_query_len, causal=True)``
    [T, Hq] fp32: each row's log2-sum-exp split along the keys (see the function), for few rows over long KV.

``received_attention(q, k_cache, block_tables, kv_lens, query_start_loc, lse, scale, width, max_query_len,
causal=True, reduce="sum")``
    q, k_cache, block_tables, kv_lens, query_start_loc: as ``paged_prefill_attention``
    lse:    [T, Hq] fp32, each query row's log2-sum-exp of ``q . k * scale * log2(e)`` (the prefill kernel
            writes it with ``lse=``)
    width:  host int >= max(kv_lens): columns of the output
    returns [B, Hkv, width] fp32 (0 past each request's length)

Grid (cdiv(width, BLOCK_N), B, Hkv): a program loads one BLOCK_N-slot key tile of one KV head once and walks
the request's query tiles (BLOCK_Q tokens x GROUP heads as the rows of one tile, as in the prefill kernel),
recomputing ``p = exp2(q . k * scale_log2 - lse)`` and reducing it over the rows. Causal query tiles that see
no slot of the key tile are skipped. Its FLOPs equal one more QK^T pass of the prefill; its only output is
the [B, Hkv, width] reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, head_tile, next_pow2

_LOG2E = 1.4426950408889634


SUM, MAX, TILE_LSE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # what ``_key_tile_kernel`` computes


@triton.jit
def _key_tile_kernel(
    q_ptr, k_ptr, bt_ptr, lens_ptr, qsl_ptr, lse_ptr, out_ptr, m_ptr, l_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_btb,
    stride_ob, stride_oh, stride_mt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, MODE: tl.constexpr,
):
    """One BLOCK_N-slot key tile of one KV head against every query tile of its request that sees it.
    MODE SUM / MAX: ``p = exp2(q . k * scale_log2 - lse)`` reduced over the rows into ``out`` [B, Hkv, width];
    MODE TILE_LSE: each row's max logit over the tile and the sum of exp2(logit - max) into ``m`` / ``l``
    [tiles, T, Hq]."""
    tile = tl.program_id(0)
    n0 = tile * BLOCK_N
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    num_q_heads = tl.num_programs(2) * GROUP
    kv_len = tl.load(lens_ptr + b)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_len
    if n0 < kv_len:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        ctx = kv_len - q_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        dot_ty = tl.float32 if UPCAST else k_ptr.dtype.element_ty
        page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        k_rows = k_ptr + kvh.to(tl.int64) * stride_kh + (page * stride_kp + in_page * stride_ks)[:, None]
        if NUM_D == 1:  # the whole key tile held across the query tiles
            k = tl.load(k_rows + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(dot_ty)
        head = kvh * GROUP + offs_m % GROUP
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = 0
        if CAUSAL:  # query token t sees slots < ctx + t + 1: tokens before n0 - ctx see none of this tile
            first = tl.maximum(n0 - ctx, 0) // BLOCK_Q * BLOCK_Q
        for q0 in range(first, q_len, BLOCK_Q):
            tok_q = q0 + offs_m // GROUP
            row_mask = (offs_m < BLOCK_Q * GROUP) & (tok_q < q_len)
            q_rows = (q_start + tok_q).to(tl.int64)
            q_at = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
            if NUM_D == 1:
                q = tl.load(q_at + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(dot_ty)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            else:  # wide heads (a latent of 576): BLOCK_D-channel slices of q and k, the key slices re-read
                s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for c in range(NUM_D):
                    offs_c = c * BLOCK_D + offs_d
                    c_mask = offs_c < HEAD_DIM
                    kc = tl.load(k_rows + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
                    qc = tl.load(q_at + offs_c[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
                    s += tl.dot(qc.to(dot_ty), tl.trans(kc.to(dot_ty)), input_precision=PRECISION)
            s = s * scale_log2
            visible = row_mask[:, None] & n_mask[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] < ctx + tok_q[:, None] + 1)
            if MODE == TILE_LSE:
                s = tl.where(visible, s, float("-inf"))
                m = tl.max(s, 1)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                l = tl.sum(tl.where(visible, tl.exp2(s - m_safe[:, None]), 0.0), 1)
                at = tile.to(tl.int64) * stride_mt + q_rows * num_q_heads + head
                tl.store(m_ptr + at, m, mask=row_mask)
                tl.store(l_ptr + at, l, mask=row_mask)
            else:
                lse = tl.load(lse_ptr + q_rows * num_q_heads + head, mask=row_mask, other=float("inf"))
                p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
                if MODE == MAX:
                    total = tl.maximum(total, tl.max(p, 0))
                else:
                    total += tl.sum(p, 0)
        if MODE != TILE_LSE:
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + kvh * stride_oh + offs_n, total, mask=n_mask)


def _launch(mode: tl.constexpr, q, k_cache, block_tables, kv_lens, query_start_loc, scale, width, max_query_len, causal,
            block_n, lse=None, out=None, m=None, l=None) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    for name, t in (("q", q), ("k_cache", k_cache), ("block_tables", block_tables), ("kv_lens", kv_lens),
                    ("query_start_loc", query_start_loc)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0 or batch == 0 or width == 0:
        return
    group = num_q_heads // num_kv_heads
    block_m = max(16, min(64, next_pow2(max(max_query_len, 1) * group)), next_pow2(group))
    upcast, precision = dot_args(_key_tile_kernel, q.dtype)
    block_d = head_tile(head_dim)
    dummy = out if out is not None else m  # the outputs this mode does not write
    _key_tile_kernel[(triton.cdiv(width, block_n), batch, num_kv_heads)](
        q, k_cache, block_tables, kv_lens, query_start_loc, dummy if lse is None else lse,
        dummy if out is None else out, dummy if m is None else m, dummy if l is None else l,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0,
        m.stride(0) if m is not None else 0,
        GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_D=triton.cdiv(head_dim, block_d), PAGE_SIZE=page_size, CAUSAL=causal,
        UPCAST=upcast, PRECISION=precision, MODE=mode.value,
    )


@triton.jit
def _merge_lse_kernel(m_ptr, l_ptr, out_ptr, rows, tiles, BLOCK: tl.constexpr):
    """Per (row, head) entry: log2 sum_t l_t * 2^(m_t - max_t m_t) + max, over the key tiles' partials. The tile
    count is a runtime bound: as a constexpr every history length would compile a kernel of its own."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < rows
    top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for t in range(tiles):
        top = tl.maximum(top, tl.load(m_ptr + t * rows + offs, mask=mask, other=float("-inf")))
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(tiles):
        m = tl.load(m_ptr + t * rows + offs, mask=mask, other=float("-inf"))
        total += tl.load(l_ptr + t * rows + offs, mask=mask, other=0.0) * tl.exp2(m - safe)
    tl.store(out_ptr + offs, tl.where(total > 0, safe + tl.log2(total), float("-inf")), mask=mask)


def merge_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """[tiles, T, Hq] partial maxima and sums (log2 domain) -> [T, Hq] log2-sum-exp (-inf where every sum is 0):
    one launch for what is a dozen small torch kernels (``agentrt_kernels.torch_ref.received_attention``'s
    ``merge_lse``)."""
    tiles = m.shape[0]
    out = torch.empty(m.shape[1:], dtype=torch.float32, device=m.device)
    rows = out.numel()
    if rows:
        block = 256
        _merge_lse_kernel[(triton.cdiv(rows, block),)](m.contiguous(), l.contiguous(), out, rows, tiles, BLOCK=block)
    return out


def paged_lse(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
              query_start_loc: torch.Tensor, scale: float, width: int, max_query_len: int, causal: bool = True,
              block_n: int = 64) -> torch.Tensor:
    """[T, Hq] fp32 log2-sum-exp of every query row over its visible slots (the prefill kernel's ``lse=``
    quantity) split along the keys: one program per key tile and KV head, partial (max, sum) per tile merged
    by ``merge_lse``. For a few query rows over a long context (an observation window), where the prefill kernel
    would stream the whole context through one program per query tile. Rows that see no slot get -inf."""
    tiles = max(triton.cdiv(width, block_n), 1)
    # what a tile no row of which sees a slot leaves: (-inf, 0)
    m = torch.full((tiles, q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros_like(m)
    _launch(TILE_LSE, q, k_cache, block_tables, kv_lens, query_start_loc, scale, width, max_query_len, causal,
            block_n, m=m, l=l)
    return merge_lse(m, l)


def received_attention(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, lse: torch.Tensor, scale: float, width: int,
                       max_query_len: int, causal: bool = True, block_n: int = 64,
                       reduce: str = "sum", out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``: a [B, Hkv, >= width] fp32 buffer (rows contiguous) to write into instead of a zeroed one: written
    at each request's slots, left as it is past them."""
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    assert lse.shape == q.shape[:2] and lse.is_contiguous(), lse.shape
    if out is None:
        out = torch.zeros(block_tables.shape[0], k_cache.shape[2], max(width, 1), dtype=torch.float32,
                          device=q.device)
    assert out.shape[:2] == (block_tables.shape[0], k_cache.shape[2]) and out.shape[2] >= width, out.shape
    assert out.dtype == torch.float32 and out.stride(2) == 1, (out.dtype, out.stride())
    _launch(MAX if reduce == "max" else SUM, q, k_cache, block_tables, kv_lens, query_start_loc, scale, width,
            max_query_len, causal, block_n, lse=lse, out=out)
    return out[:, :, :width]
