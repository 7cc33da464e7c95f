"""Importance scorers for prefix-cache pruning: which tokens inside a pruned interval are worth keeping.

A scorer reads a chain's retained KV (through the cache manager) and scores slots; higher = keep. Scorers
live in ``policies/`` and register by name (``engine.registry.register_scorer`` or the ``agentrt.scorers``
entry-point group).

A scorer either overrides ``score`` (one layer from the stored KV, e.g. key norms) or ``score_table`` (every
layer at once, with the chain's tokens and a ``probe`` that runs the model over extra query tokens against the
retained KV without changing it: see ``engine/probe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.contract.cache import CacheManager


@dataclass(slots=True, frozen=True)
class ScoreContext:
    """What a scorer may read: the table, the logical tokens whose KV it holds (``token_ids``, length
    ``num_computed``) and the engine's probe (``engine.probe.Prober``; None where no model is at hand)."""

    cache: CacheManager
    table: Any
    token_ids: list[int]
    num_computed: int
    num_layers: int
    probe: Any = None


class ImportanceScorer:
    name: ClassVar[str] = "base"
    needs_probe: ClassVar[bool] = False  # score_table calls ctx.probe

    def score(self, cache: CacheManager, table: Any, layer: int) -> torch.Tensor:
        """[num_kv_heads, physical_len(layer)] float scores for every slot of ``table`` in ``layer``."""
        raise NotImplementedError

    def score_table(self, ctx: ScoreContext) -> list[torch.Tensor]:
        """Per layer ``[num_kv_heads, physical_len(layer)]`` scores; defaults to ``score`` layer by layer."""
        return [self.score(ctx.cache, ctx.table, layer) for layer in range(ctx.num_layers)]
