"""Paged decode attention over quantized KV, dequantizing inside the attention loop (flash-decoding splits).

``quantized_decode_attention(q, fmt, k_fields, v_fields, block_tables, kv_lens, quant_lens, window_k, window_v,
window_ids, scale, num_splits=None)``
    q:              [B, Hq, D] fp32 / fp16 / bf16
    fmt:            one of FORMATS
    k/v_fields:     one layer's codec side tensors (see below), page-shaped [num_pages, page_size // g, Hkv, w]
    block_tables:   [B, max_pages] int32; kv_lens / quant_lens: [B] int32 (slots < quant_len are read from
                    codes, the rest from the window ring)
    window_k/v:     [num_windows, capacity, Hkv, D] in q's dtype, or None (then quant_lens == kv_lens);
    window_ids:     [B] int32 (ring of request b; slot s at s % capacity)
    returns         [B, Hq, D] in q's dtype

Formats:
* ``e4m3-token-head``: codes uint8 [P, ps, Hkv, D] (E4M3 bits), scale fp32 [P, ps, Hkv, 1]; x = e4m3(code) *
  scale. The scale is applied to the logits (keys) and to the probabilities (values), not to the tiles.
* ``int4-asym-kchan-vtok`` / ``int2-asym-kchan-vtok`` (KIVI): codes uint8 [P, ps, Hkv, D b / 8] in planes,
  byte j holding channels j + p D b / 8 (p = 0 .. 8 / b - 1) at bit p b; keys: scale / zero fp16 [P, ps / G,
  Hkv, D] (per channel over G tokens); values: scale / zero fp16 [P, ps, Hkv, D / Gv] (per token over Gv
  channels); x = code * scale + zero. A tile unpacks every channel from its byte and plane, so Q K^T and
  P V run as full-width dots.

* ``lloydmax-rotated-bitplanes`` (TurboQuant): codes uint8 [P, ps, Hkv, D b / 8] as b bit planes (plane p,
  bytes [p D / 8, (p + 1) D / 8), holds bit p of every channel's index, channel c at byte c // 8, bit c % 8),
  norm fp32 [P, ps, Hkv, 1]; x = norm * (levels[index] @ R) for the codec's rotation R ([D, D]) and
  Lloyd-Max levels (``tables``). Attention runs in the rotated basis: the query enters as q R^T, each tile
  is ``norm * levels[index]``, and the output leaves as o R (no window: this codec keeps none).
* ``lowrank-latent-rope`` (Palu): latents and positions, reconstructed inside the loop by
  ``agentrt_kernels.triton.lowrank_decode`` (its own kernel; ``tables`` holds the layer's bases, biases and RoPE).

Grid and split structure as ``decode_attention``: one program per (request, KV head, split) owns the whole
query-head group and walks its slots in two loops, coded slots [start, quant_len) then window slots; partials
are merged by ``decode_attention``'s combine kernel. Under TRITON_INTERPRET=1 all math is fp32.

What keeps a coded tile cheap (each choice read off the sm_90a SASS, ``benchmarks/kernel_resources.py``):
per-token and per-group factors move out of the tiles (E4M3's scales onto the logits and probabilities;
a key group's scale and zero onto the query when a tile lies inside one group, ``q . (c s + z) = (q s) . c
+ q . z``), codes become floats by bit operations (E4M3 by the hardware unpack to fp16; small integers as
fp16 ``1024 + c``, two to an instruction, or fp32 ``2^23 + c``) instead of int-to-float instructions, bf16
queries dot in fp16 (where the fp16-stored KIVI scales dequantize without a rounding to bf16), value scales
are loaded once per group and broadcast, a tile that lies inside one page looks the page up once instead of
per slot, and 2/4-bit tiles are never reordered into channel order (one dot and one accumulator per code
plane), so the loads stay plain tiles that the compiler pipelines through shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import cdiv, check_last_dim_contiguous, dot_args, next_pow2
from agentrt_kernels.triton.decode_attention import (
    DEFAULT_MIN_SPLIT_TOKENS,
    combine_splits,
    split_partials,
    split_range,
)

FORMATS = ("e4m3-token-head", "int4-asym-kchan-vtok", "int2-asym-kchan-vtok", "lloydmax-rotated-bitplanes",
           "lowrank-latent-rope")
_INT_BITS = {"int4-asym-kchan-vtok": 4, "int2-asym-kchan-vtok": 2}
# Default launch per format: (slots per tile, pipelining stages, splits as a multiple of the dense kernel's
# ``choose_num_splits``), the fastest of ``python -m benchmarks.codec_kernels``' grid on an H200 (Llama-3.1-8B
# attention, page 32, 27 x 32K and 7 x 128K; figures in docs/benchmarks.md). Twice the dense kernel's splits: a
# coded program holds more registers (fewer programs per SM) and does more work per byte, so more, shorter
# programs keep the memory system busier.
_DEFAULT_LAUNCH = {"e4m3-token-head": (128, 2, 2), "int4-asym-kchan-vtok": (32, 3, 2),
                   "int2-asym-kchan-vtok": (64, 2, 2)}
_LOG2E = 1.4426950408889634


@triton.jit
def _split_program(lens_ptr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                   MIN_SPLIT: tl.constexpr):
    """This program of the (request, KV head, split) grid: (b, kvh, split, query heads, and its slots
    [start, end), BLOCK_N-aligned since MIN_SPLIT is a multiple of BLOCK_N)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = split_range(lens_ptr + b, split, BLOCK_N, NUM_SPLITS, MIN_SPLIT)
    return b, kvh, split, tl.num_programs(1) * GROUP, start, end


@triton.jit
def _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Store acc / l for channels ``offs_d`` (a whole head, or one code plane's channel range)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (b.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)


@triton.jit
def _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS: tl.constexpr):
    if NUM_SPLITS > 1:
        row = (b.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(mid_lse_ptr + row, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def _softmax_step(qk, n_mask, m_i, l_i):
    """Online softmax over one tile of scaled logits qk [G, N] (log2 domain): (p, rescale of old sums, m, l)."""
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _online_update(qk, v, n_mask, m_i, l_i, acc, DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of the online softmax: scaled logits qk [G, N] (log2 domain), values v [N, D]."""
    p, alpha, m_i, l_i = _softmax_step(qk, n_mask, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _small_ints_to_f32(c):
    """Non-negative int32 codes < 2^23 as exact fp32 without an int-to-float instruction (2^23 + c has c as
    its mantissa)."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes_to(c, DOT_TY: tl.constexpr):
    """Non-negative int32 codes < 2^10 as exact floats of the dots' type: fp16 as 1024 + c (c in the
    mantissa of 0x6400) less 1024, which the compiler packs two to an instruction; fp32 as above."""
    if DOT_TY == tl.float16:
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        return _small_ints_to_f32(c)


@triton.jit
def _fp8_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, bt_ptr, lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qb, stride_qh,
    s_cp, s_cs, s_ch, s_sp, s_ss, s_sh,
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP16: tl.constexpr,
):
    """Coded slots: E4M3 tiles converted by the hardware, per-token scales applied to the logits (keys) and
    to the probabilities (values), so a tile costs a conversion per element and nothing else (every slot is
    coded: the format keeps no window). DOT_FP16 (bf16 queries on a GPU): the dots take fp16 operands, which
    E4M3 unpacks to in one instruction per two elements (bf16 would need a second conversion); the query
    enters pre-multiplied by the softmax scale, exact in fp16 up to 65504 / scale in magnitude."""
    b, kvh, split, num_q_heads, start, end = _split_program(lens_ptr, GROUP, NUM_SPLITS, BLOCK_N, MIN_SPLIT)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dot_ty = tl.float32 if UPCAST else (tl.float16 if DOT_FP16 else q_ptr.dtype.element_ty)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = (q * scale_log2).to(dot_ty)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page (tiles are BLOCK_N-aligned): one lookup
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            off = n0 % PAGE_SIZE + offs_n
            slot = page * s_cp + kvh * s_ch + off * s_cs
            sslot = page * s_sp + kvh * s_sh + off * s_ss
        else:
            page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            off = (tok % PAGE_SIZE).to(tl.int64)
            slot = page * s_cp + off * s_cs + kvh * s_ch
            sslot = page * s_sp + off * s_ss + kvh * s_sh
        cmask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + slot[:, None] + offs_d[None, :], mask=cmask, other=0)
        k = k.to(tl.float8e4nv, bitcast=True).to(dot_ty)
        k_scale = tl.load(ks_ptr + sslot, mask=n_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_scale[None, :]
        p, alpha, m_i, l_i = _softmax_step(qk, n_mask, m_i, l_i)
        v = tl.load(vc_ptr + slot[:, None] + offs_d[None, :], mask=cmask, other=0)
        v = v.to(tl.float8e4nv, bitcast=True).to(dot_ty)
        v_scale = tl.load(vs_ptr + sslot, mask=n_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(dot_ty), v, input_precision=PRECISION)
    _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


@triton.jit
def _key_plane_logits(qk, q_p, kc, ks_ptr, kz_ptr, krow, cmask, P: tl.constexpr, BITS: tl.constexpr,
                      W: tl.constexpr, GROUPED: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
    """qk += q_p . k_p for code plane P (channels P W .. P W + W - 1) of a key tile.

    GROUPED (the tile lies inside one key group): ``krow`` is that group's scalar row, and
    q . (c s + z) = (q * s) . c + q . z, so the codes enter the dot as they are and the group's
    scale and zero touch only the query. Otherwise ``krow`` [N] holds each slot's group row and the tile
    is dequantized per element."""
    ch = P * W + tl.arange(0, W)
    codes = _codes_to((kc >> (P * BITS)) & ((1 << BITS) - 1), DOT_TY)
    if GROUPED:
        s = tl.load(ks_ptr + krow + ch).to(tl.float32)
        z = tl.load(kz_ptr + krow + ch).to(tl.float32)
        qk += tl.dot((q_p * s[None, :]).to(DOT_TY), tl.trans(codes.to(DOT_TY)), input_precision=PRECISION)
        qk += tl.sum(q_p * z[None, :], 1)[:, None]
    else:  # dequantized in the dots' type (fp16: one rounding of c s + z; the scales are stored in fp16)
        rows = krow[:, None] + ch[None, :]
        k = codes * tl.load(ks_ptr + rows, mask=cmask, other=0.0).to(DOT_TY) \
            + tl.load(kz_ptr + rows, mask=cmask, other=0.0).to(DOT_TY)
        qk += tl.dot(q_p.to(DOT_TY), tl.trans(k.to(DOT_TY)), input_precision=PRECISION)
    return qk


@triton.jit
def _value_plane(acc_p, p, vc, vs_ptr, vz_ptr, vrow, cmask, P: tl.constexpr, BITS: tl.constexpr,
                 W: tl.constexpr, VGROUP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_TY: tl.constexpr,
                 PRECISION: tl.constexpr):
    """acc_p += p . v_p for code plane P of a value tile; each slot's (scale, zero) per VGROUP channels is
    loaded once per group and broadcast over the group's channels (a [N, groups, width] view)."""
    GP: tl.constexpr = W // VGROUP if W > VGROUP else 1  # value groups inside the plane
    GW: tl.constexpr = W // GP
    codes = _codes_to((vc >> (P * BITS)) & ((1 << BITS) - 1), DOT_TY)
    g = (P * W) // VGROUP + tl.arange(0, GP)
    rows = vrow[:, None] + g[None, :]
    s = tl.load(vs_ptr + rows, mask=cmask, other=0.0).to(DOT_TY)
    z = tl.load(vz_ptr + rows, mask=cmask, other=0.0).to(DOT_TY)
    v = tl.reshape(codes, [BLOCK_N, GP, GW]) * s[:, :, None] + z[:, :, None]
    v = tl.reshape(v, [BLOCK_N, W])
    return acc_p + tl.dot(p.to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION)


@triton.jit
def _load_plane(ptr, rows, mask, P: tl.constexpr, W: tl.constexpr):
    """Channels P W .. P W + W - 1 of the rows ``rows`` [N] of a full-precision tensor -> [N, W] fp32."""
    return tl.load(ptr + rows[:, None] + P * W + tl.arange(0, W)[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _intn_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr, bt_ptr, lens_ptr, qlens_ptr, wid_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qb, stride_qh,
    s_cp, s_cs, s_ch,  # codes (k and v share the layout)
    s_kp, s_kg, s_kh,  # key scale / zero [P, ps / G, Hkv, D]
    s_vp, s_vs, s_vh,  # value scale / zero [P, ps, Hkv, D / Gv]
    s_wn, s_wc, s_wh,
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr, CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, DOT_FP16: tl.constexpr,
):
    """Works plane by plane (a byte holds 8 / BITS channels, one per plane of W = D BITS / 8 channels): the
    logits sum one dot per plane, the output keeps one accumulator per plane, so no tile is ever shuffled
    into channel order. Coded slots first, then the window's full-precision slots. DOT_FP16 (bf16 queries
    on a GPU): the dots take fp16 operands, to which codes convert two to an instruction and in which the
    fp16-stored scales and zeros dequantize exactly (bf16 would round them); the window's bf16 tiles and the
    probabilities enter the dots as fp16 too (the codec's fp16 zeros already bound the values to fp16's range)."""
    b, kvh, split, num_q_heads, start, end = _split_program(lens_ptr, GROUP, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    coded_end = end
    if HAS_WINDOW:
        coded_end = tl.minimum(end, tl.load(qlens_ptr + b))
    W: tl.constexpr = HEAD_DIM * BITS // 8
    PLANES: tl.constexpr = 8 // BITS
    GROUPED: tl.constexpr = KGROUP % BLOCK_N == 0  # every tile inside one key group (tiles are aligned)

    offs_g = tl.arange(0, BLOCK_G)
    offs_w = tl.arange(0, W)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    w_mask = offs_w < W
    dot_ty = tl.float32 if UPCAST else (tl.float16 if DOT_FP16 else q_ptr.dtype.element_ty)
    q_rows = b.to(tl.int64) * stride_qb + head * stride_qh
    q0 = _load_plane(q_ptr, q_rows, g_mask[:, None], 0, W)
    q1 = _load_plane(q_ptr, q_rows, g_mask[:, None], 1, W)
    q2 = q0  # planes 2 and 3 exist at 2 bits only
    q3 = q0
    if PLANES == 4:
        q2 = _load_plane(q_ptr, q_rows, g_mask[:, None], 2, W)
        q3 = _load_plane(q_ptr, q_rows, g_mask[:, None], 3, W)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc0 = tl.full([BLOCK_G, W], 0.0, dtype=tl.float32)
    acc1 = tl.full([BLOCK_G, W], 0.0, dtype=tl.float32)
    acc2 = tl.full([BLOCK_G, W], 0.0, dtype=tl.float32)
    acc3 = tl.full([BLOCK_G, W], 0.0, dtype=tl.float32)
    for n0 in range(start, coded_end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < coded_end
        if PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page (tiles are BLOCK_N-aligned): one lookup
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            off = n0 % PAGE_SIZE + offs_n
            code_row = (page * s_cp + kvh * s_ch + off * s_cs)[:, None] + offs_w[None, :]
        else:
            page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            off = (tok % PAGE_SIZE).to(tl.int64)
            code_row = (page * s_cp + off * s_cs + kvh * s_ch)[:, None] + offs_w[None, :]
        cmask = n_mask[:, None]
        kc = tl.load(kc_ptr + code_row, mask=cmask, other=0).to(tl.int32)
        if GROUPED:
            page0 = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            krow = page0 * s_kp + (n0 % PAGE_SIZE) // KGROUP * s_kg + kvh * s_kh
        else:
            krow = page * s_kp + off // KGROUP * s_kg + kvh * s_kh
        qk = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
        qk = _key_plane_logits(qk, q0, kc, ks_ptr, kz_ptr, krow, cmask, 0, BITS, W, GROUPED, dot_ty, PRECISION)
        qk = _key_plane_logits(qk, q1, kc, ks_ptr, kz_ptr, krow, cmask, 1, BITS, W, GROUPED, dot_ty, PRECISION)
        if PLANES == 4:
            qk = _key_plane_logits(qk, q2, kc, ks_ptr, kz_ptr, krow, cmask, 2, BITS, W, GROUPED, dot_ty, PRECISION)
            qk = _key_plane_logits(qk, q3, kc, ks_ptr, kz_ptr, krow, cmask, 3, BITS, W, GROUPED, dot_ty, PRECISION)
        p, alpha, m_i, l_i = _softmax_step(qk * scale_log2, n_mask, m_i, l_i)
        vc = tl.load(vc_ptr + code_row, mask=cmask, other=0).to(tl.int32)
        vrow = page * s_vp + off * s_vs + kvh * s_vh
        a = alpha[:, None]
        acc0 = _value_plane(acc0 * a, p, vc, vs_ptr, vz_ptr, vrow, cmask, 0, BITS, W, VGROUP, BLOCK_N, dot_ty, PRECISION)
        acc1 = _value_plane(acc1 * a, p, vc, vs_ptr, vz_ptr, vrow, cmask, 1, BITS, W, VGROUP, BLOCK_N, dot_ty, PRECISION)
        if PLANES == 4:
            acc2 = _value_plane(acc2 * a, p, vc, vs_ptr, vz_ptr, vrow, cmask, 2, BITS, W, VGROUP, BLOCK_N, dot_ty,
                                PRECISION)
            acc3 = _value_plane(acc3 * a, p, vc, vs_ptr, vz_ptr, vrow, cmask, 3, BITS, W, VGROUP, BLOCK_N, dot_ty,
                                PRECISION)
    if HAS_WINDOW:
        wid = tl.load(wid_ptr + b).to(tl.int64)
        for n0 in range(tl.maximum(start, coded_end), end, BLOCK_N):
            tok = n0 + offs_n
            n_mask = tok < end
            rows = wid * s_wn + (tok % CAP).to(tl.int64) * s_wc + kvh * s_wh
            wm = n_mask[:, None]
            qk = tl.dot(q0.to(dot_ty), tl.trans(_load_plane(wk_ptr, rows, wm, 0, W).to(dot_ty)),
                        input_precision=PRECISION)
            qk += tl.dot(q1.to(dot_ty), tl.trans(_load_plane(wk_ptr, rows, wm, 1, W).to(dot_ty)),
                         input_precision=PRECISION)
            if PLANES == 4:
                qk += tl.dot(q2.to(dot_ty), tl.trans(_load_plane(wk_ptr, rows, wm, 2, W).to(dot_ty)),
                             input_precision=PRECISION)
                qk += tl.dot(q3.to(dot_ty), tl.trans(_load_plane(wk_ptr, rows, wm, 3, W).to(dot_ty)),
                             input_precision=PRECISION)
            p, alpha, m_i, l_i = _softmax_step(qk * scale_log2, n_mask, m_i, l_i)
            pd = p.to(dot_ty)
            a = alpha[:, None]
            acc0 = acc0 * a + tl.dot(pd, _load_plane(wv_ptr, rows, wm, 0, W).to(dot_ty), input_precision=PRECISION)
            acc1 = acc1 * a + tl.dot(pd, _load_plane(wv_ptr, rows, wm, 1, W).to(dot_ty), input_precision=PRECISION)
            if PLANES == 4:
                acc2 = acc2 * a + tl.dot(pd, _load_plane(wv_ptr, rows, wm, 2, W).to(dot_ty),
                                         input_precision=PRECISION)
                acc3 = acc3 * a + tl.dot(pd, _load_plane(wv_ptr, rows, wm, 3, W).to(dot_ty),
                                         input_precision=PRECISION)
    _finish(acc0, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, offs_w, w_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _finish(acc1, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, W + offs_w, w_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    if PLANES == 4:
        _finish(acc2, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, 2 * W + offs_w, w_mask, split,
                num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
        _finish(acc3, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, 3 * W + offs_w, w_mask, split,
                num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


@triton.jit
def _lloydmax_decode_kernel(
    q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, lv_ptr, bt_ptr, lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qb, stride_qh,
    s_cp, s_cs, s_ch,  # codes (k and v share the layout)
    s_np, s_ns, s_nh,  # norms [P, ps, Hkv, 1]
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    b, kvh, split, num_q_heads, start, end = _split_program(lens_ptr, GROUP, NUM_SPLITS, BLOCK_N, MIN_SPLIT)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    byte = (offs_d // 8)[None, :]
    bit = (offs_d % 8)[None, :]
    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0).to(dot_ty)  # already rotated: q R^T
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = (tok % PAGE_SIZE).to(tl.int64)
        cmask = n_mask[:, None]
        code_row = (page * s_cp + off * s_cs + kvh * s_ch)[:, None]
        k_idx = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.int32)
        v_idx = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.int32)
        for p in tl.static_range(BITS):
            plane = code_row + p * (HEAD_DIM // 8) + byte
            k_idx += ((tl.load(kc_ptr + plane, mask=cmask, other=0).to(tl.int32) >> bit) & 1) << p
            v_idx += ((tl.load(vc_ptr + plane, mask=cmask, other=0).to(tl.int32) >> bit) & 1) << p
        nrow = page * s_np + off * s_ns + kvh * s_nh
        k = tl.load(lv_ptr + k_idx) * tl.load(kn_ptr + nrow, mask=n_mask, other=0.0)[:, None]
        v = tl.load(lv_ptr + v_idx) * tl.load(vn_ptr + nrow, mask=n_mask, other=0.0)[:, None]
        qk = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=PRECISION) * scale_log2
        acc, m_i, l_i = _online_update(qk, v, n_mask, m_i, l_i, acc, dot_ty, PRECISION)
    _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


def unsupported_shape(fmt: str, head_dim: int) -> str | None:
    """Why the kernel for ``fmt`` cannot run at ``head_dim`` (None if it can): the 2/4-bit kernels take one
    dot per code plane of ``head_dim * bits / 8`` channels, which ``tl.dot`` needs to be a power of two >= 16."""
    if fmt in _INT_BITS:
        width = head_dim * _INT_BITS[fmt] // 8
        if width < 16 or width != next_pow2(width):
            return (f"the {fmt} decode kernel needs head_dim * bits / 8 (here {width}) to be a power of two "
                    f">= 16")
    return None


def quantized_decode_attention(
    q: torch.Tensor, fmt: str, k_fields: dict[str, torch.Tensor], v_fields: dict[str, torch.Tensor],
    block_tables: torch.Tensor, kv_lens: torch.Tensor, quant_lens: torch.Tensor,
    window_k: torch.Tensor | None, window_v: torch.Tensor | None, window_ids: torch.Tensor | None,
    scale: float, num_splits: int | None = None, *, tables: dict[str, torch.Tensor] | None = None,
    block_n: int | None = None, num_warps: int = 4, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
    num_stages: int | None = None,
) -> torch.Tensor:
    """See the module docstring; ``tables``: the codec's ``kernel_tables`` (the Lloyd-Max format's rotation
    and levels); ``block_n``, ``num_stages``, ``num_splits``: the launch (slots per tile, Triton's software
    pipelining depth, context splits), each the format's ``_DEFAULT_LAUNCH`` when None (the low-rank kernel
    takes its own stages)."""
    if fmt not in FORMATS:
        raise ValueError(f"no quantized decode kernel for format {fmt!r}; formats: {FORMATS}")
    unsupported = unsupported_shape(fmt, q.shape[-1])
    if unsupported:
        raise ValueError(unsupported)
    default_block_n, default_stages, split_factor = _DEFAULT_LAUNCH.get(fmt, (32, None, 1))
    block_n = block_n or default_block_n
    num_stages = default_stages if num_stages is None else num_stages
    min_split_tokens = cdiv(max(0, int(min_split_tokens)), block_n) * block_n  # splits stay tile-aligned
    if fmt == "lowrank-latent-rope":
        from agentrt_kernels.triton.lowrank_decode import lowrank_decode_attention

        assert window_k is None, "the low-rank format keeps no full-precision window"
        return lowrank_decode_attention(q, k_fields, v_fields, block_tables, kv_lens, scale, tables, num_splits,
                                        block_n=block_n, num_warps=num_warps, min_split_tokens=min_split_tokens)
    batch, num_q_heads, head_dim = q.shape
    kc = k_fields["codes"]
    num_kv_heads = kc.shape[2]
    assert num_q_heads % num_kv_heads == 0 and block_tables.shape[0] == batch
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_lens", kv_lens)
    check_last_dim_contiguous("quant_lens", quant_lens)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    page_size = kc.shape[1]
    group = num_q_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    num_splits, mid_o, mid_lse = split_partials(out, num_kv_heads, block_tables.shape[1] * page_size, num_splits,
                                                split_factor)
    has_window = window_k is not None
    if not has_window:
        window_k = window_v = q.new_zeros(1, 1, 1, 1)
        window_ids = kv_lens
    grid = (batch, num_kv_heads, num_splits)
    scale_log2 = scale * _LOG2E
    common_tail = dict(BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_SPLIT=min_split_tokens, num_warps=num_warps)
    if num_stages is not None:
        common_tail["num_stages"] = num_stages
    wstrides = window_k.stride()[:3]
    if fmt == FORMATS[0]:
        kernel = _fp8_decode_kernel
        upcast, precision = dot_args(kernel, q.dtype)
        ks = k_fields["scale"]
        assert not has_window, "the E4M3 format keeps no full-precision window"
        kernel[grid](
            q, kc, ks, v_fields["codes"], v_fields["scale"], block_tables, kv_lens,
            out, mid_o, mid_lse, scale_log2, q.stride(0), q.stride(1),
            *kc.stride()[:3], *ks.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), PAGE_SIZE=page_size,
            UPCAST=upcast, PRECISION=precision,
            DOT_FP16=q.dtype == torch.bfloat16 and not upcast, **common_tail)
    elif fmt == "lloydmax-rotated-bitplanes":
        assert not has_window and head_dim == next_pow2(head_dim) and tables is not None
        rotation, levels = tables["rotation"], tables["levels"]
        qr = (q.float() @ rotation.T).to(q.dtype)  # scores in the rotated basis: q . (y R) = (q R^T) . y
        kernel = _lloydmax_decode_kernel
        upcast, precision = dot_args(kernel, q.dtype)
        kn = k_fields["norm"]
        out_rot = torch.empty(out.shape, dtype=torch.float32, device=q.device)
        kernel[grid](
            qr, kc, kn, v_fields["codes"], v_fields["norm"], levels, block_tables, kv_lens,
            out_rot, mid_o, mid_lse, scale_log2, qr.stride(0), qr.stride(1),
            *kc.stride()[:3], *kn.stride()[:3], block_tables.stride(0), out_rot.stride(0), out_rot.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BITS=kc.shape[3] * 8 // head_dim,
            PAGE_SIZE=page_size, UPCAST=upcast, PRECISION=precision, **common_tail)
        combine_splits(mid_o, mid_lse, out_rot)
        out.copy_(out_rot @ rotation)  # back to the model's basis
        return out
    else:
        kernel = _intn_decode_kernel
        upcast, precision = dot_args(kernel, q.dtype)
        bits = _INT_BITS[fmt]
        assert head_dim == next_pow2(head_dim), "int decode kernels need a power-of-two head_dim"
        ks, vs = k_fields["scale"], v_fields["scale"]
        kernel[grid](
            q, kc, ks, k_fields["zero"], v_fields["codes"], vs, v_fields["zero"], window_k, window_v, block_tables,
            kv_lens, quant_lens, window_ids, out, mid_o, mid_lse, scale_log2, q.stride(0), q.stride(1),
            *kc.stride()[:3], *ks.stride()[:3], *vs.stride()[:3], *wstrides, block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BITS=bits, PAGE_SIZE=page_size,
            KGROUP=page_size // ks.shape[1], VGROUP=head_dim // vs.shape[3], CAP=window_k.shape[1],
            HAS_WINDOW=has_window, UPCAST=upcast, PRECISION=precision,
            DOT_FP16=q.dtype == torch.bfloat16 and not upcast, **common_tail)
    combine_splits(mid_o, mid_lse, out)
    return out
