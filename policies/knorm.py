"""Knorm scorer: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024): keys
with a low L2 norm draw high attention, so a token's importance is ``-||k||_2`` of its post-RoPE key, per
(layer, KV head). Used by prefix-cache pruning (``engine.LLMEngine.prune_chain(..., scorer="knorm")``).
"""

from __future__ import annotations

import torch

from engine.contract.scorer import ImportanceScorer
from engine.registry import register_scorer


@register_scorer
class KnormScorer(ImportanceScorer):
    name = "knorm"

    def score(self, cache, table, layer: int) -> torch.Tensor:
        keys = cache.table_keys(table, layer)  # [n, Hkv, D]
        return -keys.float().norm(dim=-1).T  # [Hkv, n]
