"""NeoX-style (rotate-half) rotary embedding, in place, optionally fused with the paged-KV store.

``apply_rotary(positions, q, k, cos_cache, sin_cache) -> (q, k)``
    positions: [T] int64; q: [T, Hq, D], k: [T, Hkv, D] (strided views of a packed qkv are fine; last dim
    contiguous); cos_cache/sin_cache: [max_pos, D/2] as engine.models.layers.RotaryEmbedding builds them
    (fp32 math, stored in the model dtype, attention scale already folded in). q and k are rotated in
    place and returned.

``rotary_and_store(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, *,
inplace_k=False) -> q``
    Rotates q in place and writes rotated k and v ([T, Hkv, D]) into k_cache/v_cache
    ([num_pages, page_size, Hkv, D]) at slot_mapping [T] int64 (slots < 0 skipped); k itself is left as
    it is unless ``inplace_k``.

Math matches RotaryEmbedding exactly: with x1, x2 the two halves and c, s the cached cos/sin row,
out = (x1*c - x2*s, x2*c + x1*s), every product and sum rounded to promote(x.dtype, cos.dtype) as torch
does elementwise, then stored in x's dtype. One program per token rotates all heads of q and k (one 2-D
[heads, D/2] tile per half), so each cos/sin row is read once per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_last_dim_contiguous, next_pow2


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
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CDT: tl.constexpr, STORE_KV: tl.constexpr, WRITE_K: tl.constexpr,
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
    o1, o2 = _rope(x1, x2, c, s, CDT)
    tl.store(p1, o1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(q_ptr.dtype.element_ty), mask=mask)

    # k: in place and/or into the paged cache (with v)
    offs_h = tl.arange(0, BLOCK_HKV)
    mask = (offs_h[:, None] < HKV) & d_mask[None, :]
    p1 = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
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


def _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv, write_k):
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert head_dim % 2 == 0 and cos_cache.shape[-1] == head_dim // 2 == sin_cache.shape[-1], cos_cache.shape
    assert positions.shape == (num_tokens,), positions.shape
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, t)
    num_kv_heads = k.shape[1]
    compute = torch.promote_types(torch.promote_types(q.dtype, cos_cache.dtype), sin_cache.dtype)
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
        positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vt, vh,
        cos_cache.stride(0), sin_cache.stride(0),
        *kv_strides,
        HQ=num_q_heads, HKV=num_kv_heads, HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        PAGE_SIZE=page_size, CDT=_TL_DTYPES[compute], STORE_KV=store_kv, WRITE_K=write_k,
        num_warps=max(1, min(8, block_hq * block_half // 512)),
    )


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the cos/sin rows at ``positions``; returns (q, k)."""
    _launch(positions, q, k, None, cos_cache, sin_cache, None, None, None, store_kv=False, write_k=True)
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
) -> torch.Tensor:
    """Rotate q in place; write rotated k and v to the paged cache at slot_mapping (slots < 0 skipped)."""
    _launch(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, store_kv=True,
            write_k=inplace_k)
    return q
