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
  ``kernels.triton.lowrank_decode`` (its own kernel; ``tables`` holds the layer's bases, biases and RoPE).

Grid and split structure as ``decode_attention``: one program per (request, KV head, split) owns the whole
query-head group; a tile of BLOCK_N slots mixes coded slots and window slots by masked loads; partials are
merged by ``decode_attention``'s combine kernel. Under TRITON_INTERPRET=1 all math is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2
from kernels.triton.decode_attention import DEFAULT_MIN_SPLIT_TOKENS, combine_splits, split_partials

FORMATS = ("e4m3-token-head", "int4-asym-kchan-vtok", "int2-asym-kchan-vtok", "lloydmax-rotated-bitplanes",
           "lowrank-latent-rope")
_INT_BITS = {"int4-asym-kchan-vtok": 4, "int2-asym-kchan-vtok": 2}
_LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_to_f32(b):
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e > 0, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)), m * 0.001953125)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _split_range(lens_ptr, b, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    kv_len = tl.load(lens_ptr + b)
    per_split = ((kv_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    per_split = tl.maximum(per_split, MIN_SPLIT)  # see decode_attention: few full splits for short requests
    start = split * per_split
    return start, tl.minimum(start + per_split, kv_len)


@triton.jit
def _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
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
def _online_update(qk, v, n_mask, m_i, l_i, acc, DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of the online softmax: scaled logits qk [G, N] (log2 domain), values v [N, D]."""
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fp8_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, wk_ptr, wv_ptr, bt_ptr, lens_ptr, qlens_ptr, wid_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qb, stride_qh,
    s_cp, s_cs, s_ch, s_sp, s_ss, s_sh,
    s_wn, s_wc, s_wh,
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    start, end = _split_range(lens_ptr, b, split, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    quant_len = tl.load(qlens_ptr + b)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    wid = 0
    if HAS_WINDOW:
        wid = tl.load(wid_ptr + b).to(tl.int64)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        coded = n_mask & (tok < quant_len)
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=coded, other=0).to(tl.int64)
        slot = page * s_cp + (tok % PAGE_SIZE).to(tl.int64) * s_cs + kvh * s_ch
        sslot = page * s_sp + (tok % PAGE_SIZE).to(tl.int64) * s_ss + kvh * s_sh
        cmask = coded[:, None] & d_mask[None, :]
        k = _e4m3_to_f32(tl.load(kc_ptr + slot[:, None] + offs_d[None, :], mask=cmask, other=0))
        v = _e4m3_to_f32(tl.load(vc_ptr + slot[:, None] + offs_d[None, :], mask=cmask, other=0))
        k = k * tl.load(ks_ptr + sslot, mask=coded, other=0.0)[:, None]
        v = v * tl.load(vs_ptr + sslot, mask=coded, other=0.0)[:, None]
        if HAS_WINDOW:
            windowed = n_mask & (tok >= quant_len)
            wrow = wid * s_wn + (tok % CAP).to(tl.int64) * s_wc + kvh * s_wh
            wmask = windowed[:, None] & d_mask[None, :]
            k += tl.load(wk_ptr + wrow[:, None] + offs_d[None, :], mask=wmask, other=0.0).to(tl.float32)
            v += tl.load(wv_ptr + wrow[:, None] + offs_d[None, :], mask=wmask, other=0.0).to(tl.float32)
        qk = tl.dot(q.to(dot_ty), tl.trans(k.to(dot_ty)), input_precision=PRECISION) * scale_log2
        acc, m_i, l_i = _online_update(qk, v, n_mask, m_i, l_i, acc, dot_ty, PRECISION)
    _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


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
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    start, end = _split_range(lens_ptr, b, split, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    quant_len = tl.load(qlens_ptr + b)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    width: tl.constexpr = HEAD_DIM * BITS // 8  # bytes per token: channel c is byte c % width, plane c // width
    byte = (offs_d % width)[None, :]
    shift = ((offs_d // width) * BITS)[None, :]
    vgroup = (offs_d // VGROUP)[None, :]
    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0).to(dot_ty)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    wid = 0
    if HAS_WINDOW:
        wid = tl.load(wid_ptr + b).to(tl.int64)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        coded = n_mask & (tok < quant_len)
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=coded, other=0).to(tl.int64)
        off = (tok % PAGE_SIZE).to(tl.int64)
        cmask = coded[:, None]
        code_row = (page * s_cp + off * s_cs + kvh * s_ch)[:, None]
        kq = (tl.load(kc_ptr + code_row + byte, mask=cmask, other=0).to(tl.int32) >> shift) & ((1 << BITS) - 1)
        vq = (tl.load(vc_ptr + code_row + byte, mask=cmask, other=0).to(tl.int32) >> shift) & ((1 << BITS) - 1)
        krow = (page * s_kp + (off // KGROUP) * s_kg + kvh * s_kh)[:, None] + offs_d[None, :]
        k = kq.to(tl.float32) * tl.load(ks_ptr + krow, mask=cmask, other=0.0).to(tl.float32) \
            + tl.load(kz_ptr + krow, mask=cmask, other=0.0).to(tl.float32)
        vrow = (page * s_vp + off * s_vs + kvh * s_vh)[:, None] + vgroup
        v = vq.to(tl.float32) * tl.load(vs_ptr + vrow, mask=cmask, other=0.0).to(tl.float32) \
            + tl.load(vz_ptr + vrow, mask=cmask, other=0.0).to(tl.float32)
        if HAS_WINDOW:
            windowed = (n_mask & (tok >= quant_len))[:, None]
            wrow = (wid * s_wn + (tok % CAP).to(tl.int64) * s_wc + kvh * s_wh)[:, None] + offs_d[None, :]
            k += tl.load(wk_ptr + wrow, mask=windowed, other=0.0).to(tl.float32)
            v += tl.load(wv_ptr + wrow, mask=windowed, other=0.0).to(tl.float32)
        qk = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=PRECISION) * scale_log2
        acc, m_i, l_i = _online_update(qk, v, n_mask, m_i, l_i, acc, dot_ty, PRECISION)
    _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, b, head, g_mask, offs_d, d_mask, split,
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
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    start, end = _split_range(lens_ptr, b, split, NUM_SPLITS, BLOCK_N, MIN_SPLIT)

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
    _finish(acc, m_i, l_i, out_ptr, mid_o_ptr, mid_lse_ptr, b, head, g_mask, offs_d, d_mask, split,
            num_q_heads, stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS)
    _store_lse(m_i, l_i, mid_lse_ptr, b, head, g_mask, split, num_q_heads, NUM_SPLITS)


def quantized_decode_attention(
    q: torch.Tensor, fmt: str, k_fields: dict[str, torch.Tensor], v_fields: dict[str, torch.Tensor],
    block_tables: torch.Tensor, kv_lens: torch.Tensor, quant_lens: torch.Tensor,
    window_k: torch.Tensor | None, window_v: torch.Tensor | None, window_ids: torch.Tensor | None,
    scale: float, num_splits: int | None = None, *, tables: dict[str, torch.Tensor] | None = None,
    block_n: int = 32, num_warps: int = 4, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
) -> torch.Tensor:
    """See the module docstring; ``tables``: the codec's ``kernel_tables`` (the Lloyd-Max format's rotation
    and levels)."""
    if fmt not in FORMATS:
        raise ValueError(f"no quantized decode kernel for format {fmt!r}; formats: {FORMATS}")
    if fmt == "lowrank-latent-rope":
        from kernels.triton.lowrank_decode import lowrank_decode_attention

        assert window_k is None, "the low-rank format keeps no full-precision window"
        return lowrank_decode_attention(q, k_fields, v_fields, block_tables, kv_lens, scale, tables, num_splits,
                                        block_n=block_n, num_warps=num_warps, min_split_tokens=min_split_tokens)
    batch, num_q_heads, head_dim = q.shape
    kc = k_fields["codes"]
    num_kv_heads = kc.shape[2]
    assert num_q_heads % num_kv_heads == 0 and block_tables.shape[0] == batch
    check_last_dim_contiguous("q", q)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    page_size = kc.shape[1]
    group = num_q_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    num_splits, mid_o, mid_lse = split_partials(out, num_kv_heads, block_tables.shape[1] * page_size, num_splits)
    has_window = window_k is not None
    if not has_window:
        window_k = window_v = q.new_zeros(1, 1, 1, 1)
        window_ids = kv_lens
    grid = (batch, num_kv_heads, num_splits)
    scale_log2 = scale * _LOG2E
    common_tail = dict(BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_SPLIT=max(0, int(min_split_tokens)),
                       num_warps=num_warps)
    wstrides = window_k.stride()[:3]
    if fmt == FORMATS[0]:
        kernel = _fp8_decode_kernel
        upcast, precision = dot_args(kernel, q.dtype)
        ks = k_fields["scale"]
        kernel[grid](
            q, kc, ks, v_fields["codes"], v_fields["scale"], window_k, window_v, block_tables, kv_lens, quant_lens,
            window_ids, out, mid_o, mid_lse, scale_log2, q.stride(0), q.stride(1),
            *kc.stride()[:3], *ks.stride()[:3], *wstrides, block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), PAGE_SIZE=page_size,
            CAP=window_k.shape[1], HAS_WINDOW=has_window, UPCAST=upcast, PRECISION=precision, **common_tail)
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
            HAS_WINDOW=has_window, UPCAST=upcast, PRECISION=precision, **common_tail)
    combine_splits(mid_o, mid_lse, out)
    return out
