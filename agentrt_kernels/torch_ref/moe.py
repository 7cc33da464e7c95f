"""Reference top-k routed SwiGLU experts: what ``agentrt_kernels.triton.moe.fused_moe`` computes. Tokens are
grouped by expert and each expert that got tokens runs once (a host sync: the per-expert counts)."""

import torch
import torch.nn.functional as F

from agentrt_kernels.torch_ref.activation import silu_and_mul


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (gate rows first); w_down [E, H, I]; topk_weights [T, K] in x.dtype;
    topk_ids [T, K] int64 -> [T, H] in x.dtype: sum over k of topk_weights * expert(x)."""
    top_k = topk_ids.shape[1]
    slots_by_expert = topk_ids.flatten().argsort(stable=True)
    tokens_by_expert = slots_by_expert // top_k
    weights_by_expert = topk_weights.flatten()[slots_by_expert]
    counts = torch.bincount(topk_ids.flatten(), minlength=w_gate_up.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = tokens_by_expert[start : start + count]
        h = silu_and_mul(F.linear(x[tokens], w_gate_up[expert]))
        h = F.linear(h, w_down[expert]) * weights_by_expert[start : start + count, None]
        out.index_add_(0, tokens, h)
        start += count
    return out
