"""The MLA split kernel with the latent rows of whole tiles read by the tensor memory accelerator (TMA).

``mla_paged_decode(..., tma=True)`` runs this kernel in place of ``mla_decode._mla_split_kernel`` (same grid,
same partials, same combine). Why: the gather kernel computes a 64-bit address for every 16 bytes each thread
copies (``cp.async``) and reads the page table once a row; at decode sizes its instructions are mostly that
address arithmetic, not tensor-core work (the Nsight Compute counts are in docs/benchmarks.md). A tile of
BLOCK_N latent rows that lies inside one page is one contiguous block of the pool, so one TMA copy per operand
brings it into shared memory from a page id and a row number.

Layout: the pool as a 2-D tensor [num_pages * page_size, Dk] (rows of a page consecutive), two descriptors:
[BLOCK_N, HALF] boxes for the value channels (a TMA box is at most 256 elements a side, so the 512 latent
channels come as two halves, each its own operand: S = Q_0 K_0^T + Q_1 K_1^T + Q_r K_r^T, O_h = P K_h) and
[BLOCK_N, BLOCK_DR] for the rest (the rope channels). Channels past Dk arrive as zeros (TMA fills out of
bounds); channels of the second half past Dv meet zero query channels and are not stored.

Tiles: a split's range starts BLOCK_N-aligned (``decode_attention.split_range``), so every tile but the split's
last is full; full tiles go through TMA, unmasked; the last, partial tile (if any) is gathered row by row with
its masks, as the gather kernel does (rows past kv_len read as zeros, never as whatever the pool holds there).
TMA needs BLOCK_N dividing the page size (a tile never crosses pages), 16-bit rows, Dv <= 512, 16-byte aligned
rows (``tma_layout``); where the pool does not allow it (``TMA=False``: the engine's 16-row pages under 64-row
tiles) every tile is gathered, still in halves.

The halves also shorten the logits' chain of dependent tensor-core ops: a head tile of 32 times 64 rows leaves
each warp a 16 x 16 piece of S, whose product over K = 576 is one chain of 36 mma.sync when written as one dot
(or as a sum the compiler folds into one); each part scaled on its own is a chain of its own (16, 16, 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import pdl_enter
from agentrt_kernels.triton.mla_tiles import row_starts, split_program, store_split_lse, store_split_values

MAX_BOX = 256  # elements a side of one TMA box


def tma_fits(latent: torch.Tensor, block_n: int, dv: int) -> bool:
    """Whether this kernel can read the pool [num_pages, page_size, Dk] by TMA in tiles of ``block_n`` rows: page
    size a multiple of BLOCK_N, rows of a page consecutive, 16-bit, Dv <= 512, rows and base 16-byte aligned."""
    page_size, stride_p, stride_s = latent.shape[1], latent.stride(0), latent.stride(1)
    return not (latent.dtype not in (torch.float16, torch.bfloat16) or page_size % block_n or block_n > MAX_BOX
                or triton.next_power_of_2(dv) > 2 * MAX_BOX or latent.stride(-1) != 1
                or stride_p != page_size * stride_s or (stride_s * latent.element_size()) % 16
                or latent.data_ptr() % 16)


def tma_layout(latent: torch.Tensor, block_n: int, dv: int, dk: int) -> torch.Tensor | None:
    """The pool [num_pages, page_size, Dk] as the 2-D row view the descriptors take, or None where this kernel
    does not apply (``tma_fits``)."""
    if not tma_fits(latent, block_n, dv):
        return None
    return latent.as_strided((latent.shape[0] * latent.shape[1], dk), (latent.stride(1), 1))


def tma_descriptors(rows: torch.Tensor, block_n: int, half: int, block_dr: int):
    """(value-halves descriptor, rest descriptor) over ``tma_layout``'s row view."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(rows, [block_n, half]),
            TensorDescriptor.from_tensor(rows, [block_n, block_dr]))


@triton.jit
def _attend_tile(q_0, q_1, q_r, k_0, k_1, k_r, n_mask, m_i, l_i, acc_0, acc_1, scale_log2,
                 HAS_REST: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of rows (k_0, k_1: the value halves, k_r: the rest) into the running softmax (base 2) and the
    two accumulators. Each part of the logits is scaled on its own: the compiler folds a sum of plain products
    into one chain of dependent mma over all of K; scaled, the parts' chains run side by side."""
    qk = tl.dot(q_0, tl.trans(k_0), input_precision=PRECISION) * scale_log2
    qk += tl.dot(q_1, tl.trans(k_1), input_precision=PRECISION) * scale_log2
    if HAS_REST:
        qk += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION) * scale_log2
    if MASKED:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(k_0.dtype)
    acc_0 = acc_0 * alpha[:, None] + tl.dot(p, k_0, input_precision=PRECISION)
    acc_1 = acc_1 * alpha[:, None] + tl.dot(p, k_1, input_precision=PRECISION)
    return m_new, l_i, acc_0, acc_1


@triton.jit
def _mla_split_tma_kernel(
    q_ptr, kv_ptr, v_desc, r_desc, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, num_heads,
    stride_qb, stride_qh,
    stride_kp, stride_ks,
    stride_btb,
    stride_ob, stride_oh,
    BLOCK_H: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr, DK: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_REST: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b, split, start, end, head, h_mask = split_program(lens_ptr, num_heads, BLOCK_H, BLOCK_N, NUM_SPLITS, MIN_SPLIT)
    offs_0 = tl.arange(0, HALF)  # the first half of the value channels
    offs_1 = HALF + offs_0  # the second half (past DV: channels the query zeroes)
    offs_r = DV + tl.arange(0, BLOCK_DR)  # the rest of the key (the rope part)
    offs_n = tl.arange(0, BLOCK_N)

    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
    q_0 = tl.load(q_rows + offs_0[None, :], mask=h_mask[:, None] & (offs_0 < DV)[None, :], other=0.0).to(dot_ty)
    q_1 = tl.load(q_rows + offs_1[None, :], mask=h_mask[:, None] & (offs_1 < DV)[None, :], other=0.0).to(dot_ty)
    q_r = q_0  # not read without a rest
    if HAS_REST:
        q_r = tl.load(q_rows + offs_r[None, :], mask=h_mask[:, None] & (offs_r < DK)[None, :], other=0.0)
        q_r = q_r.to(dot_ty)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc_0 = tl.full([BLOCK_H, HALF], 0.0, dtype=tl.float32)
    acc_1 = tl.full([BLOCK_H, HALF], 0.0, dtype=tl.float32)
    full_end = start
    if TMA:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):  # whole tiles: one page's consecutive rows, by TMA
            row = tl.load(bt_row + n0 // PAGE_SIZE) * PAGE_SIZE + n0 % PAGE_SIZE
            k_0 = v_desc.load([row, 0]).to(dot_ty)
            k_1 = v_desc.load([row, HALF]).to(dot_ty)
            k_r = k_0  # not read without a rest
            if HAS_REST:
                k_r = r_desc.load([row, DV]).to(dot_ty)
            m_i, l_i, acc_0, acc_1 = _attend_tile(q_0, q_1, q_r, k_0, k_1, k_r, offs_n, m_i, l_i, acc_0, acc_1,
                                                  scale_log2, HAS_REST, False, PRECISION)
    # without TMA every tile, with it the split's last tile if partial: gathered row by row, rows masked
    for n0 in range(full_end, end, BLOCK_N):
        n_mask, page, slot, rows = row_starts(bt_row, kv_ptr, n0, offs_n, end, PAGE_SIZE, stride_kp, stride_ks)
        k_0 = tl.load(rows[:, None] + offs_0[None, :], mask=n_mask[:, None] & (offs_0 < DK)[None, :], other=0)
        k_1 = tl.load(rows[:, None] + offs_1[None, :], mask=n_mask[:, None] & (offs_1 < DK)[None, :], other=0)
        k_0, k_1 = k_0.to(dot_ty), k_1.to(dot_ty)
        k_r = k_0
        if HAS_REST:
            k_r = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & (offs_r < DK)[None, :], other=0)
            k_r = k_r.to(dot_ty)
        m_i, l_i, acc_0, acc_1 = _attend_tile(q_0, q_1, q_r, k_0, k_1, k_r, n_mask, m_i, l_i, acc_0, acc_1,
                                              scale_log2, HAS_REST, True, PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_split_values(out_ptr, mid_o_ptr, b, head, split, num_heads, stride_ob, stride_oh, offs_0,
                       h_mask[:, None] & (offs_0 < DV)[None, :], acc_0 / l_safe, DV, NUM_SPLITS)
    store_split_values(out_ptr, mid_o_ptr, b, head, split, num_heads, stride_ob, stride_oh, offs_1,
                       h_mask[:, None] & (offs_1 < DV)[None, :], acc_1 / l_safe, DV, NUM_SPLITS)
    store_split_lse(mid_lse_ptr, b, head, split, num_heads, h_mask, m_i, l_i, NUM_SPLITS)
