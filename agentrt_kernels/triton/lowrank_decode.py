"""Paged decode attention over low-rank KV latents (Palu), reconstructing keys and values inside the loop.

``lowrank_decode_attention(q, k_fields, v_fields, block_tables, kv_lens, scale, tables, num_splits=None)``
    q:              [B, Hq, D] fp32 / fp16 / bf16
    k_fields:       ``latent`` [P, ps, Hkv, r] (fp16 / bf16 / fp32) and ``pos`` [P, ps, Hkv, 1] int32, the
                    token's logical position (its key is stored rotated back to position 0)
    v_fields:       ``latent`` [P, ps, Hkv, r]
    block_tables:   [B, max_pages] int32; kv_lens: [B] int32
    tables:         ``k_basis`` / ``v_basis`` [Hkv, D, r] fp32 (``U_r`` per KV head), ``k_bias`` / ``v_bias``
                    [Hkv, D] fp32, ``cos`` / ``sin`` [max_pos, D / 2] fp32 (the model's rotate-half RoPE)
    returns         [B, Hq, D] in q's dtype

A key is ``rope(U_k l + b_k, pos)``: each tile of BLOCK_N latents is multiplied by ``U_k^T`` (one dot per
half of the head, so RoPE's rotate-half pairs line up), the bias added, and the halves rotated by the
positions' cos/sin rows before ``q . k``. Values never leave the latent space inside the loop: the
probabilities multiply the value latents (``acc`` is [G, r]) and each split projects its partial output
once, ``acc @ U_v^T + l * b_v``, before the usual flash-decoding combine. Only latents and positions are
read per token: ``2 r`` latent values + 4 bytes instead of ``2 D`` values.

Grid as ``decode_attention``: one program per (request, KV head, split) owns the query-head group. The
reconstruction and P·V dots run in fp32 (IEEE for fp32 latents, tf32 otherwise); ``q . k`` in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2
from agentrt_kernels.triton.decode_attention import DEFAULT_MIN_SPLIT_TOKENS, combine_splits, split_partials
from agentrt_kernels.triton.quant_decode import _finish, _online_update, _split_program, _store_lse

FORMAT = "lowrank-latent-rope"
_LOG2E = 1.4426950408889634


@triton.jit
def _lowrank_decode_kernel(
    q_ptr, kl_ptr, kp_ptr, vl_ptr, uk_ptr, bk_ptr, uv_ptr, bv_ptr, cos_ptr, sin_ptr, bt_ptr, lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qb, stride_qh,
    s_lp, s_ls, s_lh,  # latents (k and v share the layout) [P, ps, Hkv, r]
    s_pp, s_ps, s_ph,  # positions [P, ps, Hkv, 1]
    s_uh, s_ud,  # bases [Hkv, D, r], unit stride over r
    s_bh,  # biases [Hkv, D]
    s_rope,  # cos / sin [max_pos, D / 2]
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, LAT_PRECISION: tl.constexpr,
):
    b, kvh, split, num_q_heads, start, end = _split_program(lens_ptr, GROUP, NUM_SPLITS, BLOCK_N, MIN_SPLIT)

    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    h_mask = offs_h < HALF
    r_mask = offs_r < RANK
    d_mask = offs_d < HEAD_DIM
    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q_row = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_h[None, :]
    qh_mask = g_mask[:, None] & h_mask[None, :]
    q1 = tl.load(q_row, mask=qh_mask, other=0.0).to(dot_ty)
    q2 = tl.load(q_row + HALF, mask=qh_mask, other=0.0).to(dot_ty)
    # U_k^T by halves: element (r, d) of half j is basis[kvh, d + j * HALF, r]
    uk_tile = uk_ptr + kvh * s_uh + offs_r[:, None] + offs_h[None, :] * s_ud
    u_mask = r_mask[:, None] & h_mask[None, :]
    uk1 = tl.load(uk_tile, mask=u_mask, other=0.0)
    uk2 = tl.load(uk_tile + HALF * s_ud, mask=u_mask, other=0.0)
    bk1 = tl.load(bk_ptr + kvh * s_bh + offs_h, mask=h_mask, other=0.0)
    bk2 = tl.load(bk_ptr + kvh * s_bh + HALF + offs_h, mask=h_mask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_R], 0.0, dtype=tl.float32)  # probabilities x value latents
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = (tok % PAGE_SIZE).to(tl.int64)
        lat_row = (page * s_lp + off * s_ls + kvh * s_lh)[:, None] + offs_r[None, :]
        lat_mask = n_mask[:, None] & r_mask[None, :]
        kl = tl.load(kl_ptr + lat_row, mask=lat_mask, other=0.0).to(tl.float32)
        vl = tl.load(vl_ptr + lat_row, mask=lat_mask, other=0.0).to(tl.float32)
        pos = tl.load(kp_ptr + page * s_pp + off * s_ps + kvh * s_ph, mask=n_mask, other=0).to(tl.int64)
        k1 = tl.dot(kl, uk1, input_precision=LAT_PRECISION) + bk1[None, :]
        k2 = tl.dot(kl, uk2, input_precision=LAT_PRECISION) + bk2[None, :]
        rope_row = pos[:, None] * s_rope + offs_h[None, :]
        rope_mask = n_mask[:, None] & h_mask[None, :]
        cos = tl.load(cos_ptr + rope_row, mask=rope_mask, other=0.0)
        sin = tl.load(sin_ptr + rope_row, mask=rope_mask, other=0.0)
        r1 = (k1 * cos - k2 * sin).to(dot_ty)
        r2 = (k2 * cos + k1 * sin).to(dot_ty)
        qk = (tl.dot(q1, tl.trans(r1), input_precision=PRECISION)
              + tl.dot(q2, tl.trans(r2), input_precision=PRECISION)) * scale_log2
        acc, m_i, l_i = _online_update(qk, vl, n_mask, m_i, l_i, acc, tl.float32, LAT_PRECISION)
    # back from the latent space once per split: (sum p l) U_v^T + (sum p) b_v, normalised by _finish
    uv = tl.load(uv_ptr + kvh * s_uh + offs_r[:, None] + offs_d[None, :] * s_ud,
                 mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    bv = tl.load(bv_ptr + kvh * s_bh + offs_d, mask=d_mask, other=0.0)
    o = tl.dot(acc, uv, input_precision=LAT_PRECISION) + l_i[:, None] * bv[None, :]
    _finish(o, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


def lowrank_decode_attention(
    q: torch.Tensor, k_fields: dict[str, torch.Tensor], v_fields: dict[str, torch.Tensor],
    block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float, tables: dict[str, torch.Tensor],
    num_splits: int | None = None, *, block_n: int = 32, num_warps: int = 4,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
) -> torch.Tensor:
    """See the module docstring."""
    batch, num_q_heads, head_dim = q.shape
    k_lat, k_pos, v_lat = k_fields["latent"], k_fields["pos"], v_fields["latent"]
    page_size, num_kv_heads, rank = k_lat.shape[1], k_lat.shape[2], k_lat.shape[3]
    assert num_q_heads % num_kv_heads == 0 and block_tables.shape[0] == batch and head_dim % 2 == 0
    assert v_lat.stride() == k_lat.stride(), "key and value latents must share one layout"
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_lens", kv_lens)
    uk, uv, cos = tables["k_basis"], tables["v_basis"], tables["cos"]
    assert uk.stride() == uv.stride() and uk.stride(-1) == 1 and tables["sin"].stride() == cos.stride()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    num_splits, mid_o, mid_lse = split_partials(out, num_kv_heads, block_tables.shape[1] * page_size, num_splits)
    kernel = _lowrank_decode_kernel
    upcast, precision = dot_args(kernel, q.dtype)
    lat_precision = "ieee" if k_lat.dtype == torch.float32 else "tf32"
    kernel[(batch, num_kv_heads, num_splits)](
        q, k_lat, k_pos, v_lat, uk, tables["k_bias"], uv, tables["v_bias"], cos, tables["sin"], block_tables,
        kv_lens, out, mid_o, mid_lse, scale * _LOG2E, q.stride(0), q.stride(1),
        *k_lat.stride()[:3], *k_pos.stride()[:3], uk.stride(0), uk.stride(1), tables["k_bias"].stride(0),
        cos.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        HALF=head_dim // 2, BLOCK_H=max(16, next_pow2(head_dim // 2)), RANK=rank, BLOCK_R=max(16, next_pow2(rank)),
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_SPLIT=max(0, int(min_split_tokens)),
        UPCAST=upcast, PRECISION=precision,
        LAT_PRECISION=lat_precision, num_warps=num_warps)
    combine_splits(mid_o, mid_lse, out)
    return out
