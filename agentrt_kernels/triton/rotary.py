"""NeoX-style (rotate-half) rotary embedding, in place, optionally fused with the paged-KV store.

``apply_rotary(positions, q, k, cos_cache, sin_cache, *, q_norm_weight=None, k_norm_weight=None,
norm_eps=1e-6) -> (q, k)``
    positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] (strided views of a packed qkv are fine; last dim
    contiguous); cos_cache/sin_cache: [max_pos, D/2] as engine.models.layers.RotaryEmbedding builds them
    (fp32 math, stored in the model dtype, attention scale already folded in). q and k are rotated in
    place and returned.

``rotary_and_store(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, *,
inplace_k=False, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6) -> q``
    Rotates q in place and writes rotated k and v ([T, Hkv, D]) into k_cache/v_cache
    ([num_pages, page_size, Hkv, D]) at slot_mapping [T] int64 (slots < 0 skipped); k itself is left as
    it is unless ``inplace_k``.

With ``q_norm_weight`` and ``k_norm_weight`` ([D] each) every head of q and k is first RMS-normalized as
engine.models.layers.RMSNorm does (Qwen3's q/k norm): h = x * rsqrt(mean(x^2 over the head's D values) +
norm_eps) in fp32, rounded to x's dtype, times the weight in fp32 rounded to promote(x.dtype, weight.dtype);
the rotation then runs on that, in promote(that dtype, cos.dtype), and q/k are stored in their own dtype.

Math matches RotaryEmbedding exactly: with x1, x2 the two halves and c, s the cached cos/sin row,
out = (x1*c - x2*s, x2*c + x1*s), every product and sum rounded to promote(x.dtype, cos.dtype) as torch
does elementwise, then stored in x's dtype. One program per token rotates all heads of q and k (one 2-D
[heads, D/2] tile per half), so each cos/sin row is read once per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2


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
def _head_rms_norm(x1, x2, w_ptr, offs_d, d_mask, eps, HALF: tl.constexpr, XDT: tl.constexpr,
                   NDT: tl.constexpr):
    """RMSNorm of [heads, D] rows held as two fp32 halves x1, x2 [heads, D/2] -> normalized halves (fp32)."""
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    r = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    h1 = _round(x1 * r, XDT)
    h2 = _round(x2 * r, XDT)
    return _round(h1 * w1, NDT), _round(h2 * w2, NDT)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
    norm_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CDT: tl.constexpr, STORE_KV: tl.constexpr, WRITE_K: tl.constexpr,
    QK_NORM: tl.constexpr, NDT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    # q, in place
    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h[:, None] < HQ) & d_mask[None, :]
    p1 = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, qw_ptr, offs_d, d_mask, norm_eps, HALF, q_ptr.dtype.element_ty, NDT)
    o1, o2 = _rope(x1, x2, c, s, CDT)
    tl.store(p1, o1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask)

    # k: in place and/or into the paged cache (with v)
    offs_h = tl.arange(0, BLOCK_HKV)
    mask = (offs_h[:, None] < HKV) & d_mask[None, :]
    p1 = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, kw_ptr, offs_d, d_mask, norm_eps, HALF, k_ptr.dtype.element_ty, NDT)
    o1, o2 = _rope(x1, x2, c, s, CDT)
    if WRITE_K:
        tl.store(p1, o1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(p1 + HALF, o2.to(k_ptr.dtype.element_ty), mask=mask)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            # round to k's dtype first, exactly as rotating then storing k would
            k1 = o1.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty)
            k2 = o2.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty)
            kc = kc_ptr + page * stride_kcp + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
            tl.store(kc, k1, mask=mask)
            tl.store(kc + HALF, k2, mask=mask)
            pv = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            v1 = tl.load(pv, mask=mask, other=0.0)
            v2 = tl.load(pv + HALF, mask=mask, other=0.0)
            vc = vc_ptr + page * stride_vcp + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
            tl.store(vc, v1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _norm_args(q, q_norm_weight, k_norm_weight):
    """(qk_norm, weight pointers (q, k), dtype h * weight rounds to) for the optional per-head q/k RMSNorm."""
    if q_norm_weight is None and k_norm_weight is None:
        return False, (q, q), q.dtype  # pointers unused
    assert q_norm_weight is not None and k_norm_weight is not None, "give both q_norm_weight and k_norm_weight"
    head_dim = q.shape[2]
    assert q_norm_weight.shape == (head_dim,) == k_norm_weight.shape, (q_norm_weight.shape, k_norm_weight.shape)
    assert q_norm_weight.dtype == k_norm_weight.dtype, (q_norm_weight.dtype, k_norm_weight.dtype)
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_last_dim_contiguous(name, w)
    return True, (q_norm_weight, k_norm_weight), torch.promote_types(q.dtype, q_norm_weight.dtype)


def _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv, write_k,
            q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6):
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert head_dim % 2 == 0 and cos_cache.shape[-1] == head_dim // 2 == sin_cache.shape[-1], cos_cache.shape
    assert positions.shape == (num_tokens,), positions.shape
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, t)
    num_kv_heads = k.shape[1]
    qk_norm, (q_w, k_w), norm_dtype = _norm_args(q, q_norm_weight, k_norm_weight)
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
    half = head_dim // 2
    block_hq, block_hkv, block_half = next_pow2(num_q_heads), next_pow2(num_kv_heads), next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_w, k_w,
        float(norm_eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vt, vh,
        cos_cache.stride(0), sin_cache.stride(0),
        *kv_strides,
        HQ=num_q_heads, HKV=num_kv_heads, HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        PAGE_SIZE=page_size, CDT=_TL_DTYPES[compute], STORE_KV=store_kv, WRITE_K=write_k,
        QK_NORM=qk_norm, NDT=_TL_DTYPES[norm_dtype],
        num_warps=max(1, min(8, block_hq * block_half // 512)),
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the cos/sin rows at ``positions``; returns (q, k).
    With ``q_norm_weight``/``k_norm_weight`` [D], each head is RMS-normalized (``norm_eps``) first."""
    _launch(positions, q, k, None, cos_cache, sin_cache, None, None, None, store_kv=False, write_k=True,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps)
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
) -> torch.Tensor:
    """Rotate q in place; write rotated k and v to the paged cache at slot_mapping (slots < 0 skipped).
    With ``q_norm_weight``/``k_norm_weight`` [D], each head of q and k is RMS-normalized (``norm_eps``) first."""
    _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv=True,
            write_k=inplace_k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps)
    return q
