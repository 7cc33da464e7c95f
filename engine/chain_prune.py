"""Pruning a chain's KV inside logical intervals ``[L, R)`` (prefix-cache pruning): the kept tokens chosen per
(layer, KV head) by an importance scorer, the pages freed, the logical history unchanged (the next turn with the
same tokens still resumes). A prune of a chain whose turn is in flight is queued and applied when the turn ends.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.chain_index import ChainBusyError, ChainState
from engine.contract.cache import CacheManager
from engine.contract.scorer import ImportanceScorer, ScoreContext
from engine.errors import InvalidRequestError

MAX_PRUNE_RESULTS = 4096


@dataclass(slots=True, frozen=True)
class PruneResult:
    tokens_kept: int  # slots the chain holds per layer and KV head after pruning
    tokens_freed: int  # slots dropped per layer and KV head
    pages_freed: int
    status: str = "applied"  # applied | deferred (queued behind a running turn) | failed (when it applied)
    prune_id: int | None = None  # set for a deferred prune: ``LLMEngine.prune_result(prune_id)``
    error: str | None = None


class ChainPruner:
    """``load(state)`` brings an offloaded chain's table back to the device before it is pruned."""

    def __init__(self, cache: CacheManager, num_layers: int, load: Callable[[ChainState], bool]):
        self.cache, self.num_layers, self.load = cache, num_layers, load
        self.prober = None  # engine.probe.Prober, for scorers that probe
        self.deferred: dict[str, list[tuple]] = {}  # chain id -> prunes queued behind its running turn
        self.results: dict[int, PruneResult] = {}  # oldest first; finished ones beyond the cap are dropped
        self._prune_ids = itertools.count(1)

    def prune(
        self, state: ChainState, intervals: list[tuple[int, int]], scorer: ImportanceScorer | None = None,
        keep_ratio: float = 0.0, defer: bool = True, keep_tokens: int | None = None,
    ) -> PruneResult:
        """Drop KV inside logical intervals ``[L, R)`` of a chain, keeping ``keep_ratio`` of the tokens inside
        them, or ``keep_tokens`` of them, per (layer, KV head), chosen by ``scorer`` (required when only part
        is kept). The logical history is unchanged, so the next turn with the same tokens still resumes.

        On a chain with a turn in flight the prune is queued (``defer``; else ``ChainBusyError``) and applied
        when the turn ends; the returned result has status ``deferred`` and a ``prune_id`` for
        ``prune_result``. Its intervals are checked against the chain's KV when it applies."""
        if not 0.0 <= keep_ratio <= 1.0:
            raise InvalidRequestError(f"keep_ratio must be in [0, 1], got {keep_ratio!r}")
        if scorer is None and 0.0 < keep_ratio < 1.0:
            raise InvalidRequestError("keep_ratio between 0 and 1 needs a scorer to choose the kept tokens")
        if keep_tokens is not None:
            if isinstance(keep_tokens, bool) or not isinstance(keep_tokens, int) or keep_tokens < 0:
                raise InvalidRequestError(f"keep_tokens must be an int >= 0, got {keep_tokens!r}")
            if keep_ratio:
                raise InvalidRequestError("give keep_ratio or keep_tokens, not both")
            if scorer is None and keep_tokens > 0:
                raise InvalidRequestError("keep_tokens > 0 needs a scorer to choose the kept tokens")
        for lo, hi in intervals:
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi):
                raise InvalidRequestError(f"interval [{lo}, {hi}) must satisfy 0 <= L < R")
        if not state.is_idle:
            if not defer:
                raise ChainBusyError(f"chain {state.chain_id!r} has a turn in flight")
            prune_id = next(self._prune_ids)
            self.deferred.setdefault(state.chain_id, []).append((prune_id, list(intervals), scorer, keep_ratio,
                                                                 keep_tokens))
            self.results[prune_id] = PruneResult(0, 0, 0, status="deferred", prune_id=prune_id)
            return self.results[prune_id]
        return self._prune_idle(state, intervals, scorer, keep_ratio, keep_tokens)

    def prune_result(self, prune_id: int) -> PruneResult:
        """The outcome of a prune returned as ``deferred``: still ``deferred``, ``applied`` or ``failed``."""
        result = self.results.get(prune_id)
        if result is None:
            raise InvalidRequestError(f"unknown prune_id {prune_id!r}")
        return result

    def apply_deferred(self, state: ChainState) -> None:
        """The prunes queued behind the turn that just ended on ``state``'s chain."""
        for prune_id, intervals, scorer, keep_ratio, keep_tokens in self.deferred.pop(state.chain_id, []):
            try:
                result = self._prune_idle(state, intervals, scorer, keep_ratio, keep_tokens)
                result = dataclasses.replace(result, prune_id=prune_id)
            except InvalidRequestError as exc:
                result = PruneResult(0, 0, 0, status="failed", prune_id=prune_id, error=str(exc))
            self.results[prune_id] = result
        self._drop_old_results()

    def _drop_old_results(self) -> None:
        """Keep the outcomes of the last MAX_PRUNE_RESULTS prunes (those still deferred always): a client polls a
        deferred prune's outcome soon after its turn, and a long-lived engine must not keep every one."""
        excess = len(self.results) - MAX_PRUNE_RESULTS
        for prune_id in [i for i, r in self.results.items() if r.status != "deferred"][:max(excess, 0)]:
            del self.results[prune_id]

    def _prune_idle(self, state: ChainState, intervals: list[tuple[int, int]], scorer: ImportanceScorer | None,
                    keep_ratio: float, keep_tokens: int | None = None) -> PruneResult:
        self.load(state)
        for lo, hi in intervals:
            if not hi <= state.num_computed:
                raise InvalidRequestError(
                    f"interval [{lo}, {hi}) must satisfy 0 <= L < R <= {state.num_computed} (the chain's KV)")
        table = state.table
        if table is None or not intervals:
            return PruneResult(0, 0, 0)
        scores = None
        partial = 0.0 < keep_ratio < 1.0 or bool(keep_tokens)
        if scorer is not None and partial:
            ctx = ScoreContext(self.cache, table, state.token_ids[: state.num_computed], state.num_computed,
                               self.num_layers, self.prober)
            scores = scorer.score_table(ctx)
        pages_before = len(table.pages)
        keep, dropped = [], 0
        for layer in range(self.num_layers):
            positions = self.cache.table_positions(table, layer)  # [Hkv, n]
            inside = torch.zeros_like(positions, dtype=torch.bool)
            for lo, hi in intervals:
                inside |= (positions >= lo) & (positions < hi)
            count = int(inside.sum(1).min())
            num_drop = max(0, count - keep_tokens) if keep_tokens is not None else round((1.0 - keep_ratio) * count)
            # no scorer: drop the latest (all of them when heads hold equal counts)
            rank = positions.float() if scores is None else -scores[layer].float()
            rank = rank.masked_fill(~inside, float("-inf"))  # only slots inside may be dropped
            # the lowest scores go first; ties to the earlier slot (a stable sort), the same in every layer
            drop = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :num_drop]
            kept = torch.ones_like(inside)
            kept.scatter_(1, drop, False)
            keep.append(kept.nonzero()[:, 1].view(positions.shape[0], -1))
            dropped += num_drop
        if dropped == 0 or not self.cache.compact_table(table, keep, state.num_computed):
            return PruneResult(0, 0, 0)
        state.pruned_intervals.extend(intervals)
        return PruneResult(tokens_kept=sum(k.shape[1] for k in keep) // self.num_layers,
                           tokens_freed=dropped // self.num_layers, pages_freed=pages_before - len(table.pages))
