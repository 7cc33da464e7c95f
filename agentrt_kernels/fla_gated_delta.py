"""The gated delta rule on a GPU through fla-core's Triton kernels (``fla.ops.gated_delta_rule``), in the layouts
of ``agentrt_kernels.torch_ref.gated_delta``: tokens first, the state ``[Hv, Dk, Dv]`` in fp32.

fla-core is an optional dependency (``agentrt[gpu]``); its kernels need a CUDA device even to autotune, so this
module is imported only on the GPU path (``agentrt_kernels.ops.gated_delta_*``) and ``available`` says whether
it can run. fla computes what the torch reference does: q and k L2-normed in the kernel with the same epsilon
(1e-6, ``x * rsqrt(sum(x^2) + eps)``), q scaled by ``Dk ** -0.5``, a key head serving ``Hv / Hk`` consecutive
value heads (its GVA indexing ``i_hv // (Hv // Hk)`` is the reference's ``repeat_interleave``), fp32 states.
The chunked kernel takes every prefill segment of a step in one launch (``cu_seqlens``), each from its own
initial state.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def _fla_ops():
    """fla's two entry points, or None where fla-core is not installed (logged once)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as exc:
        log.warning("fla-core is not installed (%s): gated DeltaNet layers run the torch reference on the GPU; "
                    "install agentrt[gpu] for its kernels", exc)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def available(x: torch.Tensor) -> bool:
    """Whether fla's kernels run on ``x``: a CUDA tensor and fla-core installed."""
    return x.is_cuda and _fla_ops() is not None


def chunk_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along the tokens: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; initial_states
    [N, Hv, Dk, Dv]; cu_seqlens [N + 1] int64 (sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]).
    Returns (out [T, Hv, Dv] in q.dtype, final states [N, Hv, Dk, Dv] fp32)."""
    chunk, _ = _fla_ops()
    out, final = chunk(
        q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype), scale=q.shape[-1] ** -0.5,
        initial_state=initial_states.float().contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return out[0], final


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; states
    [B, Hv, Dk, Dv]. Returns (out [B, Hv, Dv] in q.dtype, new states [B, Hv, Dk, Dv] fp32)."""
    _, recurrent = _fla_ops()
    out, final = recurrent(
        q[:, None], k[:, None], v[:, None], g=g[:, None].float(), beta=beta[:, None].to(q.dtype),
        scale=q.shape[-1] ** -0.5, initial_state=states.float().contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out[:, 0], final
