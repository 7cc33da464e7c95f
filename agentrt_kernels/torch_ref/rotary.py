"""Reference NeoX-style (rotate-half) rotary embedding, with the optional per-head q/k RMSNorm before it and the
paged-KV store after it: what ``agentrt_kernels.triton.rotary`` does in one kernel.

Unlike the kernel, which rotates in place, these return new tensors (q and k are left as they are, except k
under ``rotary_and_store(inplace_k=True)``); callers use the returned values.
"""

import torch

from agentrt_kernels.torch_ref.kv_store import store_kv
from agentrt_kernels.torch_ref.norm import rms_norm


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
    """positions [T] int64; q [T, Hq, D], k [T, Hkv, D]; cos_cache/sin_cache [max_pos, R/2] -> rotated (q, k):
    the first R <= D channels of each head rotate, the rest pass through. With ``q_norm_weight``/``k_norm_weight``
    [D], each head is RMS-normalized (``norm_eps``; Qwen3-Next's form with ``zero_centered``) first."""
    if q_norm_weight is not None or k_norm_weight is not None:
        assert q_norm_weight is not None and k_norm_weight is not None, "give both q_norm_weight and k_norm_weight"
        q = rms_norm(q, q_norm_weight, norm_eps, zero_centered=zero_centered)
        k = rms_norm(k, k_norm_weight, norm_eps, zero_centered=zero_centered)
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    width = 2 * cos.shape[-1]
    if width < x.shape[-1]:  # partial rotary: the leading channels rotate, the rest pass through
        return torch.cat((_rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
    """``apply_rotary``, then ``store_kv`` of the rotated k with v; returns the rotated q. ``inplace_k``: k is
    overwritten with its rotation too."""
    q, rotated_k = apply_rotary(positions, q, k, cos_cache, sin_cache, q_norm_weight=q_norm_weight,
                                k_norm_weight=k_norm_weight, norm_eps=norm_eps, zero_centered=zero_centered)
    store_kv(rotated_k, v, k_cache, v_cache, slot_mapping)
    if inplace_k:
        k.copy_(rotated_k)
    return q
