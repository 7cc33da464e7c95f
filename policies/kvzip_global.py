"""kvzip_global: KVzip's context-reconstruction score as a prefix-cache pruning scorer, one score per position.

Kim et al., "KVzip" (arXiv:2505.23416), applied to a chain's retained KV: the engine's probe teacher-forces
``repeat_prompt`` followed by the chain's tokens (in chunks of ``chunk_size``) right after the history; a
slot's score is the max attention it receives over the reconstruction queries and the query heads of its KV
head (``policies.kvzip.reconstruction_scores``). One score per logical position: the max over the (layer,
KV head) rows that hold it, so a prune keeps the same positions in every layer and head.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.contract.scorer import ImportanceScorer, ScoreContext
from engine.registry import register_scorer
from policies.kvzip import DEFAULT_REPEAT_PROMPT, reconstruction_scores
from policies.snapkv_global import per_position


@register_scorer
class KVzipGlobalScorer(ImportanceScorer):
    name = "kvzip_global"
    needs_probe = True
    chunk_size: ClassVar[int] = 2048
    repeat_prompt: ClassVar[str] = DEFAULT_REPEAT_PROMPT

    def score_table(self, ctx: ScoreContext) -> list[torch.Tensor]:
        repeat_ids = ctx.probe.encode(self.repeat_prompt)
        scores = reconstruction_scores(ctx.probe, ctx.table, ctx.num_computed, ctx.token_ids, repeat_ids,
                                       self.chunk_size)
        return per_position(ctx, scores, "max")
