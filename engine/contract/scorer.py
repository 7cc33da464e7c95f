"""Importance scorers for prefix-cache pruning: which tokens inside a pruned interval are worth keeping.

A scorer reads a chain's retained KV (through the cache manager) and scores slots; higher = keep. Scorers
live in ``policies/`` and register by name (``engine.registry.register_scorer`` or the ``agentrt.scorers``
entry-point group).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine.contract.cache import CacheManager


class ImportanceScorer:
    name: ClassVar[str] = "base"

    def score(self, cache: CacheManager, table: Any, layer: int) -> torch.Tensor:
        """[num_kv_heads, physical_len(layer)] float scores for every slot of ``table`` in ``layer``."""
        raise NotImplementedError
