"""Reference MoE router epilogues (HF's TopKRouter after the gate, and DeepSeek-V3's grouped sigmoid router):
what ``agentrt_kernels.triton.moe_router`` fuses into one launch each."""

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


def route_grouped_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, groups: int,
                          topk_groups: int, renormalize: bool, scaling: float, out_dtype: torch.dtype,
                          shared_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: router_logits [T, E] -> (topk_ids [T, K] int64 (unsorted), topk_weights [T, K] in
    ``out_dtype``). Sigmoid scores plus ``correction_bias`` [E] choose ``topk_groups`` of ``groups`` contiguous
    expert groups (each scored by its two best), then the top-k experts inside them; the weights are the chosen
    experts' uncorrected scores, divided by their sum when ``renormalize``, times ``scaling``. ``shared_expert``:
    one more column [T, K + 1], that id with weight 1 (a shared expert run with the routed ones)."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias
    if groups > 1:
        t, e = choice.shape
        group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
        chosen = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = (weights * scaling).to(out_dtype)
    if shared_expert is not None:
        topk_ids = torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], shared_expert)], dim=1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
    return topk_ids, weights
