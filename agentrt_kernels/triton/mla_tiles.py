"""Device helpers the MLA split kernels share (``mla_decode``'s gather kernel, ``mla_decode_tma``'s halves kernel):
a program's place in the grid, a tile of latent rows found through the page table, and the split's output -- the
normalised result itself with one split, else the partials ``decode_attention.split_partials`` lays out for the
combine."""

from __future__ import annotations

import triton
import triton.language as tl

from agentrt_kernels.triton.decode_attention import split_range


@triton.jit
def split_program(lens_ptr, num_heads, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  MIN_SPLIT: tl.constexpr):
    """This program of the grid (head tiles, splits, requests): (request b, split, the split's slots [start, end),
    its heads and their mask)."""
    split = tl.program_id(1)
    b = tl.program_id(2)
    start, end = split_range(lens_ptr + b, split, BLOCK_N, NUM_SPLITS, MIN_SPLIT)
    head = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    return b, split, start, end, head, head < num_heads


@triton.jit
def row_starts(bt_row, kv_ptr, n0, offs_n, end, PAGE_SIZE: tl.constexpr, stride_kp, stride_ks):
    """The tile of tokens [n0, n0 + BLOCK_N): (mask, page, slot in the page, latent row start) each."""
    tok = n0 + offs_n
    n_mask = tok < end
    page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = (tok % PAGE_SIZE).to(tl.int64)
    return n_mask, page, slot, kv_ptr + page * stride_kp + slot * stride_ks


@triton.jit
def store_split_values(out_ptr, mid_o_ptr, b, head, split, num_heads, stride_ob, stride_oh, offs, mask, o,
                       DV: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Channels ``offs`` of the normalised output o [BLOCK_H, len(offs)]: into out [B, Hq, DV] with one split,
    else into mid_o [B, Hq, NUM_SPLITS, DV] fp32."""
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (b.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * DV + offs[None, :], o, mask=mask)


@triton.jit
def store_split_lse(mid_lse_ptr, b, head, split, num_heads, h_mask, m_i, l_i, NUM_SPLITS: tl.constexpr):
    """The split's log2-sum-exp per head into mid_lse [B, Hq, NUM_SPLITS] (-inf for an empty split); nothing with
    one split."""
    if NUM_SPLITS > 1:
        row = (b.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=h_mask)
