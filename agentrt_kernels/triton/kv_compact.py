"""A compaction's KV moves for every layer at once: two launches instead of about six small kernels per layer.

Dense KV ``kv`` [L, 2, num_pages, page_size, H, D] (engine.storage.dense), slots addressed per layer and K / V
plane as ``kv[l, c].flatten(0, 1)``:

``gather_kept(kv, old_slots, keep) -> kept [L, 2, B, H, D]``
    kept[l, c, j, h] = kv[l, c][old_slots[keep[l, h, j]], h]; keep [L, H, B] int64 (slot indices into
    ``old_slots``, the table's physical slots before the compaction)
``scatter_kept(kv, kept, new_slots)``
    kv[l, c][new_slots[j], h] = kept[l, c, j, h] for j < B

A compaction moves a request's kept slots to the front of its own pages, so sources and destinations overlap:
everything is read (gathered) before anything is written, as the per-layer torch code does. Grid
(L * H, cdiv(B, BLOCK_J)): a program moves BLOCK_J slots of one (layer, head), K and V, each a row of D values.
Pure data movement: the results equal the torch indexing exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import next_pow2

BLOCK_J = 32


@triton.jit
def _gather_kept_kernel(kv_ptr, old_ptr, keep_ptr, out_ptr, B,
                        s_kl, s_kc, s_ks, s_kh, s_pl, s_ph, s_ol, s_oc, s_oj, s_oh,
                        H: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    lh = tl.program_id(0)
    layer, head = (lh // H).to(tl.int64), (lh % H).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < B
    idx = tl.load(keep_ptr + layer * s_pl + head * s_ph + j, mask=j_mask, other=0)
    slot = tl.load(old_ptr + idx, mask=j_mask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = j_mask[:, None] & (d < D)[None, :]
    for c in tl.static_range(2):
        src = kv_ptr + layer * s_kl + c * s_kc + slot[:, None] * s_ks + head * s_kh + d[None, :]
        dst = out_ptr + layer * s_ol + c * s_oc + j.to(tl.int64)[:, None] * s_oj + head * s_oh + d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def _scatter_kept_kernel(kv_ptr, new_ptr, kept_ptr, B,
                         s_kl, s_kc, s_ks, s_kh, s_ol, s_oc, s_oj, s_oh,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    lh = tl.program_id(0)
    layer, head = (lh // H).to(tl.int64), (lh % H).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < B
    slot = tl.load(new_ptr + j, mask=j_mask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = j_mask[:, None] & (d < D)[None, :]
    for c in tl.static_range(2):
        src = kept_ptr + layer * s_ol + c * s_oc + j.to(tl.int64)[:, None] * s_oj + head * s_oh + d[None, :]
        dst = kv_ptr + layer * s_kl + c * s_kc + slot[:, None] * s_ks + head * s_kh + d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _check_kv(kv: torch.Tensor) -> None:
    if kv.dim() != 6 or kv.shape[1] != 2 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous [layers, 2, pages, page_size, heads, head_dim] tensor, got "
                         f"{tuple(kv.shape)}")


def gather_kept(kv: torch.Tensor, old_slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """See the module docstring: kept [L, 2, B, H, D]."""
    _check_kv(kv)
    layers, _, _, _, heads, dim = kv.shape
    if keep.dim() != 3 or keep.shape[:2] != (layers, heads):
        raise ValueError(f"keep must be [{layers}, {heads}, B], got {tuple(keep.shape)}")
    kept_len = keep.shape[2]
    out = torch.empty((layers, 2, kept_len, heads, dim), dtype=kv.dtype, device=kv.device)
    if kept_len == 0:
        return out
    keep, old_slots = keep.contiguous(), old_slots.contiguous()
    _gather_kept_kernel[(layers * heads, triton.cdiv(kept_len, BLOCK_J))](
        kv, old_slots, keep, out, kept_len,
        kv.stride(0), kv.stride(1), kv.stride(3), kv.stride(4), keep.stride(0), keep.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        H=heads, D=dim, BLOCK_J=BLOCK_J, BLOCK_D=next_pow2(dim),
    )
    return out


def scatter_kept(kv: torch.Tensor, kept: torch.Tensor, new_slots: torch.Tensor) -> None:
    """See the module docstring: writes ``kept`` [L, 2, B, H, D] at slots ``new_slots[:B]`` of every layer."""
    _check_kv(kv)
    layers, _, _, _, heads, dim = kv.shape
    if kept.shape[:2] != (layers, 2) or kept.shape[3:] != (heads, dim) or not kept.is_contiguous():
        raise ValueError(f"kept must be a contiguous [{layers}, 2, B, {heads}, {dim}] tensor, got "
                         f"{tuple(kept.shape)}")
    kept_len = kept.shape[2]
    if new_slots.shape[0] < kept_len:
        raise ValueError(f"{new_slots.shape[0]} new slots for {kept_len} kept ones")
    if kept_len == 0:
        return
    new_slots = new_slots.contiguous()
    _scatter_kept_kernel[(layers * heads, triton.cdiv(kept_len, BLOCK_J))](
        kv, new_slots, kept, kept_len,
        kv.stride(0), kv.stride(1), kv.stride(3), kv.stride(4),
        kept.stride(0), kept.stride(1), kept.stride(2), kept.stride(3),
        H=heads, D=dim, BLOCK_J=BLOCK_J, BLOCK_D=next_pow2(dim),
    )
