"""snapkv_global: SnapKV's observation-window vote as a prefix-cache pruning scorer, one score per position.

Li et al., "SnapKV" (arXiv:2404.14469), applied to a chain's retained KV. With n = the chain's computed length,
w = ``window`` (at most n), queries and keys post-RoPE:

1. the observation window is the chain's last w tokens, re-run by the engine's probe at their own logical
   positions [n - w, n) against the retained slots before them (causal inside the window) -- exactly the
   queries those tokens had when the chain computed them;
2. ``vote[l, h, s] = mean over the window queries and the query heads of KV head h of the attention on s``
   (SnapKV sums over the queries: the same ranking);
3. each (layer, KV head) row is pooled over slot order with a 1D max pool of ``kernel_size`` (SnapKV's);
4. one score per logical position: the mean of the pooled votes over the (layer, KV head) rows that hold it
   (across tensor-parallel ranks too: each holds some of the KV heads);
   window positions score +inf. Every slot holding a position gets that position's score, so a prune keeps
   the same positions in every layer and head (where they all hold them).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.contract import all_reduce
from engine.contract.scorer import ImportanceScorer, ScoreContext
from engine.registry import register_scorer
from policies.scoring import pool1d


def per_position(ctx: ScoreContext, scores: list[torch.Tensor], reduce: str) -> list[torch.Tensor]:
    """Reduce per-slot scores to one per logical position (``mean`` or ``max`` over the (layer, KV head) rows
    holding it) and hand each slot its position's score."""
    positions = [ctx.cache.table_positions(ctx.table, layer) for layer in range(ctx.num_layers)]
    flat_pos = torch.cat([p.flatten() for p in positions])
    flat = torch.cat([s.flatten() for s in scores]).float()
    n = ctx.num_computed
    if reduce == "max":  # over this rank's rows, then over the tensor-parallel ranks' (identity at TP=1)
        merged = torch.full((n,), float("-inf"), device=flat.device).scatter_reduce(0, flat_pos, flat, "amax")
        merged = all_reduce(merged, "max")
    else:
        total = torch.zeros(n, device=flat.device).index_add_(0, flat_pos, flat)
        count = torch.zeros(n, device=flat.device).index_add_(0, flat_pos, torch.ones_like(flat))
        summed = all_reduce(torch.stack([total, count]), "sum")
        merged = summed[0] / summed[1].clamp(min=1)
    return [merged[p] for p in positions]


@register_scorer
class SnapKVGlobalScorer(ImportanceScorer):
    name = "snapkv_global"
    needs_probe = True
    window: ClassVar[int] = 32
    kernel_size: ClassVar[int] = 7

    def score_table(self, ctx: ScoreContext) -> list[torch.Tensor]:
        n = ctx.num_computed
        start = n - min(self.window, n)
        votes = ctx.probe.run(ctx.table, n, ctx.token_ids[start:n], start=start, reduce="mean")
        pooled = [pool1d(v, self.kernel_size, "max") for v in votes]  # window slots vote 0: never win a max
        merged = per_position(ctx, pooled, "mean")
        for layer, s in enumerate(merged):
            s.masked_fill_(ctx.cache.table_positions(ctx.table, layer) >= start, float("inf"))
        return merged
