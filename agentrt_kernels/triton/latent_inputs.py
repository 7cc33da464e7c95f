"""The absorbed MLA layer's attention inputs in one launch, matching agentrt_kernels.torch_ref.latent_inputs.

``latent_inputs(q_latent, q_pe, kv, positions, cos_cache, sin_cache, norm_weight, eps, scale, interleave,
cache_rows=None, slots=None) -> (query, row, q_pe)``
    q_latent:  [T, H, R] (the queries' nope part through ``W_UK``; strides free, last dim contiguous)
    q_pe:      [T, H, P] (their rope part, strided view of the q projection; rotated IN PLACE)
    kv:        [T, R + P] (the latent projection: R latent values, then the rope key shared by every head)
    cos_cache / sin_cache: [max_pos, P / 2] as engine.models.layers.RotaryEmbedding builds them
    norm_weight: [R], kv's dtype (the latent RMSNorm's)
    returns    query [T, H, R + P] = [q_latent, rope(q_pe)] * scale, row [T, 1, R + P] = [RMSNorm(latent),
               rope(k_pe)], and q_pe (rotated, in the half-split layout)
    cache_rows / slots: optional [S, R + P] (a latent cache's rows, last dim contiguous) and [T] int64: each
               token's row is also stored at ``cache_rows[slots[t]]`` (in the cache's dtype; slots < 0, a CUDA
               graph's padding rows, skipped): the KV store is not a launch of its own

What it replaces on a decode step: the latent's copy and RMSNorm, the two deinterleaving concatenations, the
rotation, the two concatenations and the scaling, eight launches a layer (nine with the store). Grid (T, H + 1):
program (t, h < H) writes query head h of token t (and rotates its q_pe in place: only this program reads or
writes those P values, all loads before the stores); program (t, H) writes the token's latent row (and stores
it). The math is the
reference's, rounding where it rounds: the rotation as ``agentrt_kernels.triton.rotary`` (each product and sum
rounded to promote(x, cos) dtype), the rotated q_pe rounded to its dtype before the scale, the norm as
``RMSNorm`` (normalised in fp32, rounded, times the weight, rounded). ``interleave`` (``rope_interleave``): the
rope channels are read as pairs (2i, 2i + 1) and written half-split, as the reference's deinterleave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter
from agentrt_kernels.triton.rotary import _TL_DTYPES, _rope, _round


@triton.jit
def _latent_inputs_kernel(
    ql_ptr, qpe_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, query_ptr, row_ptr, cache_ptr, slot_ptr,
    eps, scale,
    s_qlt, s_qlh, s_qpt, s_qph, s_kvt, s_cos, s_sin, s_qt, s_qh, s_rt, s_c,
    H: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, CDT: tl.constexpr, XDT: tl.constexpr, STORE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * s_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * s_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if INTERLEAVE:
        first, second = 2 * offs_d, 2 * offs_d + 1
    else:
        first, second = offs_d, offs_d + HALF
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    if h < H:
        ql = tl.load(ql_ptr + t * s_qlt + h * s_qlh + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        q_out = query_ptr + t * s_qt + h * s_qh
        tl.store(q_out + offs_r, (ql * scale).to(query_ptr.dtype.element_ty), mask=r_mask)
        pe = qpe_ptr + t * s_qpt + h * s_qph
        x1 = tl.load(pe + first, mask=d_mask, other=0.0).to(tl.float32)
        x2 = tl.load(pe + second, mask=d_mask, other=0.0).to(tl.float32)
        r1, r2 = _rope(x1, x2, c, s, CDT)
        q1 = r1.to(qpe_ptr.dtype.element_ty)
        q2 = r2.to(qpe_ptr.dtype.element_ty)
        tl.store(pe + offs_d, q1, mask=d_mask)
        tl.store(pe + HALF + offs_d, q2, mask=d_mask)
        tl.store(q_out + R + offs_d, (q1.to(tl.float32) * scale).to(query_ptr.dtype.element_ty), mask=d_mask)
        tl.store(q_out + R + HALF + offs_d, (q2.to(tl.float32) * scale).to(query_ptr.dtype.element_ty), mask=d_mask)
    else:
        src = kv_ptr + t * s_kvt
        x = tl.load(src + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, 0) / R
        normed = _round(x * tl.rsqrt(var + eps), XDT)
        w = tl.load(w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        dst = row_ptr + t * s_rt
        latent = (normed * w).to(row_ptr.dtype.element_ty)
        tl.store(dst + offs_r, latent, mask=r_mask)
        k1 = tl.load(src + R + first, mask=d_mask, other=0.0).to(tl.float32)
        k2 = tl.load(src + R + second, mask=d_mask, other=0.0).to(tl.float32)
        o1, o2 = _rope(k1, k2, c, s, CDT)
        o1 = o1.to(row_ptr.dtype.element_ty)
        o2 = o2.to(row_ptr.dtype.element_ty)
        tl.store(dst + R + offs_d, o1, mask=d_mask)
        tl.store(dst + R + HALF + offs_d, o2, mask=d_mask)
        if STORE:  # the row into the cache, as the store would copy it (from the row's dtype)
            slot = tl.load(slot_ptr + t)
            if slot >= 0:
                cached = cache_ptr + slot.to(tl.int64) * s_c
                out_ty = cache_ptr.dtype.element_ty
                tl.store(cached + offs_r, latent.to(out_ty), mask=r_mask)
                tl.store(cached + R + offs_d, o1.to(out_ty), mask=d_mask)
                tl.store(cached + R + HALF + offs_d, o2.to(out_ty), mask=d_mask)


def latent_inputs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: float,
    interleave: bool, cache_rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring: (query [T, H, R + P], row [T, 1, R + P], q_pe rotated in place)."""
    if q_latent.dim() != 3 or q_pe.dim() != 3 or kv.dim() != 2:
        raise ValueError(f"q_latent [T, H, R], q_pe [T, H, P] and kv [T, R + P] expected, got "
                         f"{tuple(q_latent.shape)}, {tuple(q_pe.shape)}, {tuple(kv.shape)}")
    tokens, heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if q_pe.shape[:2] != (tokens, heads) or kv.shape != (tokens, rank + rope):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} / kv {tuple(kv.shape)} do not match q_latent "
                         f"{tuple(q_latent.shape)}")
    if rope % 2 or cos_cache.shape[-1] != rope // 2 or sin_cache.shape[-1] != rope // 2:
        raise ValueError(f"rope dim {rope} must be even with cos / sin caches of {rope // 2} columns, got "
                         f"{tuple(cos_cache.shape)} / {tuple(sin_cache.shape)}")
    if positions.shape != (tokens,):
        raise ValueError(f"positions must be [{tokens}], got {tuple(positions.shape)}")
    if norm_weight.shape != (rank,) or norm_weight.dtype != kv.dtype:
        raise ValueError(f"norm_weight must be [{rank}] in {kv.dtype}, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    if not q_pe.dtype == q_latent.dtype == kv.dtype:
        raise ValueError(f"q_latent ({q_latent.dtype}), q_pe ({q_pe.dtype}) and kv ({kv.dtype}) must share a dtype")
    for name, x in (("q_latent", q_latent), ("q_pe", q_pe), ("kv", kv), ("cos_cache", cos_cache),
                    ("sin_cache", sin_cache), ("norm_weight", norm_weight)):
        check_last_dim_contiguous(name, x)
    if (cache_rows is None) != (slots is None):
        raise ValueError("cache_rows and slots go together")
    if cache_rows is not None:
        if cache_rows.dim() != 2 or cache_rows.shape[1] != rank + rope:
            raise ValueError(f"cache_rows must be [slots, {rank + rope}], got {tuple(cache_rows.shape)}")
        if slots.shape != (tokens,) or slots.dtype != torch.int64:
            raise ValueError(f"slots must be int64 [{tokens}], got {slots.dtype} {tuple(slots.shape)}")
        check_last_dim_contiguous("cache_rows", cache_rows)
    query = torch.empty((tokens, heads, rank + rope), dtype=q_latent.dtype, device=q_latent.device)
    row = torch.empty((tokens, 1, rank + rope), dtype=kv.dtype, device=kv.device)
    if tokens == 0:
        return query, row, q_pe
    compute = torch.promote_types(torch.promote_types(kv.dtype, cos_cache.dtype), sin_cache.dtype)
    block_r = next_pow2(rank)
    store = cache_rows is not None
    _latent_inputs_kernel[(tokens, heads + 1)](
        q_latent, q_pe, kv, positions, cos_cache, sin_cache, norm_weight, query, row,
        cache_rows if store else row, slots if store else positions,
        float(eps), float(scale),
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0),
        cos_cache.stride(0), sin_cache.stride(0), query.stride(0), query.stride(1), row.stride(0),
        cache_rows.stride(0) if store else 0,
        H=heads, R=rank, HALF=rope // 2, BLOCK_R=block_r, BLOCK_HALF=next_pow2(rope // 2),
        INTERLEAVE=bool(interleave), CDT=_TL_DTYPES[compute], XDT=_TL_DTYPES[kv.dtype], STORE=store,
        num_warps=max(1, min(4, block_r // 128)), PDL=(on := pdl(kv.device)), launch_pdl=on,
    )
    return query, row, q_pe
