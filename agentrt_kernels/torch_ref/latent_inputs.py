"""Reference of the absorbed MLA layer's attention inputs (engine.models.mla): what
``agentrt_kernels.triton.latent_inputs`` computes in one launch."""

import torch

from agentrt_kernels.torch_ref.norm import rms_norm
from agentrt_kernels.torch_ref.rotary import apply_rotary


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` -> ``(x0, x2, ..., x1, x3, ...)``: interleaved RoPE becomes the
    half-split RoPE of the rotary ops (HF's ``apply_rotary_pos_emb_interleave`` computes exactly this)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def latent_inputs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: float,
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_latent [T, H, R] (the queries through ``W_UK``), q_pe [T, H, P] (their rope part, not yet rotated),
    kv [T, R + P] (the latent projection: latent values, then the shared rope key) ->
    (query [T, H, R + P] = [q_latent, rotated q_pe] * scale, row [T, 1, R + P] = [RMSNorm(latent), rotated
    key], rotated q_pe [T, H, P]). ``interleave``: the rope channels come in pairs (deinterleaved first)."""
    rank = q_latent.shape[-1]
    latent, k_pe = kv.split([rank, kv.shape[-1] - rank], dim=-1)
    latent = rms_norm(latent.contiguous(), norm_weight, eps)
    k_pe = k_pe[:, None, :]
    if interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = apply_rotary(positions, q_pe.contiguous(), k_pe.contiguous(), cos_cache, sin_cache)
    query = torch.cat([q_latent, q_pe], dim=-1) * scale
    row = torch.cat([latent, k_pe[:, 0]], dim=-1)[:, None, :]
    return query, row, q_pe
