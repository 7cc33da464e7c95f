"""H2O: Heavy-Hitter Oracle eviction by accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023 (arXiv:2306.14048), Algorithm 1.

Definition implemented, per (layer, KV head h) and per kept slot s holding logical position p:

* ``acc[h, s] = sum over every query t computed so far (prompt and generated) that saw p, and over the g
  query heads j of KV head h, of A_t[j, p]`` -- A the softmax attention the query actually used (over the
  slots resident when it ran). Summing over the GQA group gives one score, hence one kept set, per KV head.
  The scores are aligned with the slots and compacted with the same keep indices, so an evicted token's
  score is gone and a kept one's keeps accumulating.
* Budget: ``heavy_budget + recent_budget`` slots. When a request holds more, it keeps its last
  ``recent_budget`` slots (the most recent positions) plus the ``heavy_budget`` non-recent slots of largest
  ``acc`` (ties to the earlier position), in position order.
* When: in ``end_step`` after every step that computed prompt tokens (chunk-wise eviction during a long
  prefill: the next chunk attends only to the kept set) and, while decoding, after every ``evict_every``-th
  generated token (``evict_every = 1`` is the paper's per-token eviction; 0 turns decode-time eviction off).

Prefix caching is turned off for this method: a prefix reused from the cache has no accumulated scores (its
queries never ran for this request), which would make its tokens the first evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, MethodNeeds, SparseMethod
from engine.paged_cache import PagedCacheManager
from engine.registry import register_method
from policies.scoring import check_int, top_k_sorted


@dataclass(slots=True, frozen=True)
class H2OConfig:
    heavy_budget: int = 1024  # heavy hitters kept among the non-recent slots
    recent_budget: int = 1024  # most recent slots always kept
    evict_every: int = 1  # decode-time eviction every N generated tokens; 0 = only during the prompt

    def __post_init__(self) -> None:
        check_int("heavy_budget", self.heavy_budget, 0)
        check_int("recent_budget", self.recent_budget, 0)
        if self.heavy_budget + self.recent_budget < 1:
            raise ValueError("heavy_budget + recent_budget must be >= 1")
        check_int("evict_every", self.evict_every, 0)

    @property
    def budget(self) -> int:
        return self.heavy_budget + self.recent_budget


class _State:
    __slots__ = ("preemptions", "acc")

    def __init__(self, req, num_layers: int):
        self.preemptions = req.num_preemptions
        self.acc: list[torch.Tensor | None] = [None] * num_layers  # per layer [Hkv, physical_len] fp32


@register_method
class H2O(SparseMethod):
    name = "h2o"
    family = Family.EVICTION
    Config = H2OConfig
    needs = MethodNeeds(attention_scores=True)
    cuda_graph_safe = False  # after_attention accumulates every step's scores on the host side

    def __init__(self, config: H2OConfig | None = None):
        super().__init__(config)
        self._states: dict[str, _State] = {}

    def make_cache(self, spec, pool, enable_prefix_caching):
        return PagedCacheManager(spec, pool, enable_prefix_caching=False)

    def _state(self, req, num_layers: int) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # new, or recomputed after a preemption
            st = self._states[req.request_id] = _State(req, num_layers)
        return st

    def release(self, req) -> None:
        self._states.pop(req.request_id, None)

    def accumulated(self, req, layer: int) -> torch.Tensor | None:
        """[Hkv, physical_len] accumulated attention of the request's slots in ``layer`` (for inspection)."""
        st = self._states.get(req.request_id)
        return None if st is None else st.acc[layer]

    def after_attention(self, layer, batch, out, scores):
        num_layers = batch.cache.spec.num_layers
        heads = batch.cache.spec.num_kv_heads
        for req, n, probs in zip(batch.requests, batch.num_new_tokens, scores):
            st = self._state(req, num_layers)
            hq, _, kv_len = probs.shape
            received = probs.sum(dim=1).view(heads, hq // heads, kv_len).sum(dim=1)  # [Hkv, kv_len]
            acc = st.acc[layer]
            old = 0 if acc is None else acc.shape[1]
            assert old == kv_len - n, "accumulated scores out of step with the request's slots"
            if acc is not None:
                received[:, :old] += acc
            st.acc[layer] = received

    def end_step(self, batch):
        cfg = self.config
        cache = batch.cache
        num_layers, heads, device = cache.spec.num_layers, cache.spec.num_kv_heads, cache.spec.device
        for req, n in zip(batch.requests, batch.num_new_tokens):
            length, prompt = req.num_computed_tokens, req.num_prompt_tokens
            size = cache.physical_len(req, 0)  # every layer has the same length under this method
            if size <= cfg.budget:
                continue
            if length - n >= prompt:  # a decode step
                if not cfg.evict_every or (length - prompt) % cfg.evict_every:
                    continue
            st = self._state(req, num_layers)
            recent = torch.arange(size - cfg.recent_budget, size, device=device).expand(heads, -1)
            keep = [torch.cat([top_k_sorted(acc[:, : size - cfg.recent_budget], cfg.heavy_budget), recent], dim=1)
                    for acc in st.acc]
            if cache.compact(req, keep):  # on failure: retried after the next step that allows eviction
                st.acc = [acc.gather(1, k) for acc, k in zip(st.acc, keep)]
