"""Reference MoE router epilogue (HF's TopKRouter after the gate): what ``agentrt_kernels.triton.moe_router``
fuses into one launch."""

import torch
import torch.nn.functional as F


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] in router_logits.dtype): fp32 softmax,
    top-k, optionally divided by their sum (``renormalize``: HF's ``norm_topk_prob``)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights.to(router_logits.dtype)
