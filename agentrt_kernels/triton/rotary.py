"""NeoX-style (rotate-half) rotary embedding, in place, optionally fused with per-head q/k RMSNorm before it and
the paged-KV store after it.

``apply_rotary(positions, q, k, cos_cache, sin_cache, *, q_norm_weight=None, k_norm_weight=None,
norm_eps=1e-6, zero_centered=False) -> (q, k)``
    positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] (strided views of a packed qkv are fine; last dim
    contiguous); cos_cache/sin_cache: [max_pos, R/2] as engine.models.layers.RotaryEmbedding builds them
    (fp32 math, stored in the model dtype, attention scale already folded in), R <= D the rotary width: the
    first R channels of each head rotate (rotate-half within them), the other D - R pass through (partial
    rotary, Qwen3-Next / Qwen3.5). q and k are rotated in place and returned.

``rotary_and_store(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, *,
inplace_k=False, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, zero_centered=False) -> q``
    Rotates q in place and writes rotated k and v ([T, Hkv, D]) into k_cache/v_cache
    ([num_pages, page_size, Hkv, D]) at slot_mapping [T] int64 (slots < 0 skipped); k itself is left as
    it is unless ``inplace_k``.

With ``q_norm_weight`` and ``k_norm_weight`` ([D] each) every head of q and k (all D channels) is first
RMS-normalized as engine.models.layers.RMSNorm does (Qwen3's q/k norm): h = x * rsqrt(mean(x^2 over the head's D
values) + norm_eps) in fp32, rounded to x's dtype, times the weight in fp32 rounded to promote(x.dtype,
weight.dtype); with ``zero_centered`` as Qwen3-Next's norm does instead: h * (1 + weight) in fp32, rounded to
x's dtype. The rotation then runs on that, in promote(that dtype, cos.dtype), and q/k are stored in their own
dtype.

Math matches RotaryEmbedding exactly: with x1, x2 the two halves of the rotary channels and c, s the cached
cos/sin row, out = (x1*c - x2*s, x2*c + x1*s), every product and sum rounded to promote(x.dtype, cos.dtype) as
torch does elementwise, then stored in x's dtype. One program per token rotates all heads of q and k (one 2-D
[heads, R/2] tile per half, one [heads, D - R] tile for the rest), so each cos/sin row is read once per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter


@triton.jit
def _rope(x1, x2, c, s, CDT: tl.constexpr):
    a = (x1 * c).to(CDT).to(tl.float32)
    b = (x2 * s).to(CDT).to(tl.float32)
    o1 = (a - b).to(CDT).to(tl.float32)
    a2 = (x2 * c).to(CDT).to(tl.float32)
    b2 = (x1 * s).to(CDT).to(tl.float32)
    o2 = (a2 + b2).to(CDT).to(tl.float32)
    return o1, o2


@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 x rounded to DT (to nearest even), returned as fp32. bf16 rounds by bit arithmetic: the interpreter's
    fp32 -> bf16 cast truncates, and the norm's two roundings feed the rotation's cancellations."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DT).to(tl.float32)


@triton.jit
def _head_rms_norm(x1, x2, x3, w_ptr, offs_d, d_mask, offs_p, p_mask, eps, HALF: tl.constexpr, PASS: tl.constexpr,
                   XDT: tl.constexpr, NDT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """RMSNorm of [heads, D] rows held in fp32 as the rotary halves x1, x2 [heads, R/2] and the rest x3
    [heads, D - R] -> the normalized parts (fp32, rounded as the torch norm rounds)."""
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)) / (2 * HALF + PASS)
    r = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w_ptr + 2 * HALF + offs_p, mask=p_mask, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTERED:
        return _round(x1 * r * (1.0 + w1), NDT), _round(x2 * r * (1.0 + w2), NDT), _round(x3 * r * (1.0 + w3), NDT)
    h1 = _round(x1 * r, XDT)
    h2 = _round(x2 * r, XDT)
    h3 = _round(x3 * r, XDT)
    return _round(h1 * w1, NDT), _round(h2 * w2, NDT), _round(h3 * w3, NDT)


@triton.jit
def _load_head_parts(ptr, offs_h, offs_d, offs_p, mask, p_mask, HALF: tl.constexpr):
    """A [heads, D] tile at ``ptr`` (rows offs_h) as fp32 rotary halves and the rest."""
    x1 = tl.load(ptr + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(ptr + 2 * HALF + offs_p[None, :], mask=p_mask, other=0.0).to(tl.float32)
    return x1, x2, x3


@triton.jit
def _store_head_parts(ptr, o1, o2, o3, offs_d, offs_p, mask, p_mask, HALF: tl.constexpr, DT: tl.constexpr):
    tl.store(ptr + offs_d[None, :], o1.to(DT), mask=mask)
    tl.store(ptr + HALF + offs_d[None, :], o2.to(DT), mask=mask)
    tl.store(ptr + 2 * HALF + offs_p[None, :], o3.to(DT), mask=p_mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
    norm_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CDT: tl.constexpr, STORE_KV: tl.constexpr, WRITE_K: tl.constexpr,
    QK_NORM: tl.constexpr, NDT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    offs_p = tl.arange(0, BLOCK_PASS)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    # q, in place (the channels past the rotary ones are written only when normalized)
    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h[:, None] < HQ) & d_mask[None, :]
    p_mask = (offs_h[:, None] < HQ) & (offs_p[None, :] < PASS)
    if not QK_NORM:
        p_mask = p_mask & (offs_p[None, :] < 0)  # unchanged channels: neither read nor written
    pq = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    x1, x2, x3 = _load_head_parts(pq, offs_h, offs_d, offs_p, mask, p_mask, HALF)
    if QK_NORM:
        x1, x2, x3 = _head_rms_norm(x1, x2, x3, qw_ptr, offs_d, d_mask, offs_p, offs_p < PASS, norm_eps, HALF,
                                    PASS, q_ptr.dtype.element_ty, NDT, ZERO_CENTERED)
    o1, o2 = _rope(x1, x2, c, s, CDT)
    _store_head_parts(pq, o1, o2, x3, offs_d, offs_p, mask, p_mask, HALF, q_ptr.dtype.element_ty)

    # k: in place and/or into the paged cache (with v)
    offs_h = tl.arange(0, BLOCK_HKV)
    mask = (offs_h[:, None] < HKV) & d_mask[None, :]
    p_mask = (offs_h[:, None] < HKV) & (offs_p[None, :] < PASS)
    pk = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh
    x1, x2, x3 = _load_head_parts(pk, offs_h, offs_d, offs_p, mask, p_mask, HALF)
    if QK_NORM:
        x1, x2, x3 = _head_rms_norm(x1, x2, x3, kw_ptr, offs_d, d_mask, offs_p, offs_p < PASS, norm_eps, HALF,
                                    PASS, k_ptr.dtype.element_ty, NDT, ZERO_CENTERED)
    o1, o2 = _rope(x1, x2, c, s, CDT)
    if WRITE_K:
        k_pass = p_mask
        if not QK_NORM:
            k_pass = p_mask & (offs_p[None, :] < 0)
        _store_head_parts(pk, o1, o2, x3, offs_d, offs_p, mask, k_pass, HALF, k_ptr.dtype.element_ty)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            # round to k's dtype first, exactly as rotating then storing k would
            kdt = k_ptr.dtype.element_ty
            kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch
            _store_head_parts(kc, o1.to(kdt), o2.to(kdt), x3.to(kdt), offs_d, offs_p, mask, p_mask, HALF,
                              kc_ptr.dtype.element_ty)
            pv = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh
            vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch
            v1, v2, v3 = _load_head_parts(pv, offs_h, offs_d, offs_p, mask, p_mask, HALF)
            _store_head_parts(vc, v1, v2, v3, offs_d, offs_p, mask, p_mask, HALF, vc_ptr.dtype.element_ty)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _norm_args(q, q_norm_weight, k_norm_weight, zero_centered):
    """(qk_norm, weight pointers (q, k), dtype the normed heads round to) for the optional per-head q/k RMSNorm."""
    if q_norm_weight is None and k_norm_weight is None:
        return False, (q, q), q.dtype  # pointers unused
    assert q_norm_weight is not None and k_norm_weight is not None, "give both q_norm_weight and k_norm_weight"
    head_dim = q.shape[2]
    assert q_norm_weight.shape == (head_dim,) == k_norm_weight.shape, (q_norm_weight.shape, k_norm_weight.shape)
    assert q_norm_weight.dtype == k_norm_weight.dtype, (q_norm_weight.dtype, k_norm_weight.dtype)
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_last_dim_contiguous(name, w)
    norm_dtype = q.dtype if zero_centered else torch.promote_types(q.dtype, q_norm_weight.dtype)
    return True, (q_norm_weight, k_norm_weight), norm_dtype


def _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv, write_k,
            q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, zero_centered=False):
    num_tokens, num_q_heads, head_dim = q.shape
    half = cos_cache.shape[-1]  # half the rotary width
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert 0 < 2 * half <= head_dim and sin_cache.shape[-1] == half, (head_dim, cos_cache.shape, sin_cache.shape)
    assert positions.shape == (num_tokens,), positions.shape
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, t)
    num_kv_heads = k.shape[1]
    qk_norm, (q_w, k_w), norm_dtype = _norm_args(q, q_norm_weight, k_norm_weight, zero_centered)
    compute = torch.promote_types(torch.promote_types(norm_dtype, cos_cache.dtype), sin_cache.dtype)
    if num_tokens == 0:
        return
    if store_kv:
        assert v.shape == k.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (v.shape, k_cache.shape)
        for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_last_dim_contiguous(name, t)
        kv_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
        vt, vh, page_size = v.stride(0), v.stride(1), k_cache.shape[1]
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # unused
        kv_strides, vt, vh, page_size = (0,) * 6, 0, 0, 1
    rest = head_dim - 2 * half  # channels past the rotary ones
    block_hq, block_hkv, block_half = next_pow2(num_q_heads), next_pow2(num_kv_heads), next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_w, k_w,
        float(norm_eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vt, vh,
        cos_cache.stride(0), sin_cache.stride(0),
        *kv_strides,
        HQ=num_q_heads, HKV=num_kv_heads, HALF=half, PASS=rest,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, BLOCK_PASS=next_pow2(max(rest, 1)),
        PAGE_SIZE=page_size, CDT=_TL_DTYPES[compute], STORE_KV=store_kv, WRITE_K=write_k,
        QK_NORM=qk_norm, NDT=_TL_DTYPES[norm_dtype], ZERO_CENTERED=zero_centered,
        num_warps=max(1, min(8, block_hq * next_pow2(head_dim) // 1024)), PDL=(on := pdl(q.device)),
        launch_pdl=on,
    )


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the cos/sin rows at ``positions``; returns (q, k).
    With ``q_norm_weight``/``k_norm_weight`` [D], each head is RMS-normalized (``norm_eps``; Qwen3-Next's form
    with ``zero_centered``) first."""
    _launch(positions, q, k, None, cos_cache, sin_cache, None, None, None, store_kv=False, write_k=True,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps, zero_centered=zero_centered)
    return q, k


def rotary_and_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    inplace_k: bool = False,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    zero_centered: bool = False,
) -> torch.Tensor:
    """Rotate q in place; write rotated k and v to the paged cache at slot_mapping (slots < 0 skipped).
    With ``q_norm_weight``/``k_norm_weight`` [D], each head of q and k is RMS-normalized (``norm_eps``; Qwen3-Next's
    form with ``zero_centered``) first."""
    _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv=True,
            write_k=inplace_k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
            zero_centered=zero_centered)
    return q
