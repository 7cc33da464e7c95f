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

* Layers are handled independently (they have the same length unless a chain was pruned): every layer
  holding more than the budget is brought back to it.

Chain turns (Chain Cache): the accumulated scores belong to the chain's KV, not to one request. When a turn
ends, ``export_state`` hands ``acc`` to the chain together with the logical position of every slot; the next
turn's ``import_state`` re-attaches it to the retained (possibly compacted) slots, matching by logical
position (so a chain pruned or cut back while idle stays aligned; a slot with no exported score starts at 0),
and the new turn's queries -- its prompt suffix, then its generated tokens -- keep adding to it. A turn's
prompt steps are the steps computing its suffix (each followed by an eviction), its decode steps evict every
``evict_every`` generated tokens *of that turn*. So a chain is exactly the single request that would have
computed the whole history with the same schedule. If the chain's scores were lost (its method state is
dropped when a turn is aborted), the retained slots resume with a score of 0.

Prefix caching is turned off for this method: a prefix reused from the cache has no accumulated scores (its
queries never ran for this request), which would make its tokens the first evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import CacheManager, Family, MethodNeeds, SparseMethod
from engine.contract.method import HOOKS_EVERY_STEP
from engine.registry import register_method
from policies.scoring import check_int, keep_all, top_k_sorted


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
    """``acc[layer]`` [Hkv, physical_len] fp32, aligned with the slots. The logical position of slot s is
    ``base_pos[layer][:, s]`` for s < m = ``base_pos[layer].shape[1]`` (the slots as of the last compaction or
    import) and ``base_logical + s - m`` after that (tokens appended since, one slot each, in order);
    ``base_logical`` is None until the first step after an import tells it."""

    __slots__ = ("preemptions", "acc", "base_pos", "base_logical")

    def __init__(self, req, num_layers: int):
        self.preemptions = req.num_preemptions
        self.acc: list[torch.Tensor | None] = [None] * num_layers
        self.base_pos: list[torch.Tensor | None] = [None] * num_layers
        self.base_logical: int | None = 0

    def positions(self, layer: int) -> torch.Tensor | None:
        acc, base = self.acc[layer], self.base_pos[layer]
        if acc is None:
            return base
        m = 0 if base is None else base.shape[1]
        start = self.base_logical if self.base_logical is not None else 0
        appended = torch.arange(start, start + acc.shape[1] - m, device=acc.device).expand(acc.shape[0], -1)
        return appended if base is None else torch.cat([base, appended], dim=1)


def align_scores(positions: torch.Tensor, acc: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Scores ``acc`` of slots at ``positions`` ([H, m], rows increasing) re-laid onto slots at ``target``
    ([H, n]): a target position found in ``positions`` takes its score, any other gets 0."""
    if positions.shape == target.shape and torch.equal(positions, target):
        return acc
    if positions.shape[1] == 0:
        return torch.zeros(target.shape, dtype=acc.dtype, device=target.device)
    idx = torch.searchsorted(positions, target).clamp_(max=positions.shape[1] - 1)
    found = positions.gather(1, idx) == target
    return torch.where(found, acc.gather(1, idx), torch.zeros((), dtype=acc.dtype, device=acc.device))


@register_method
class H2O(SparseMethod):
    name = "h2o"
    family = Family.EVICTION
    Config = H2OConfig
    needs = MethodNeeds(received_attention=True)  # [Hkv, kv_len] per request: no probability matrices
    decode = HOOKS_EVERY_STEP  # after_attention accumulates every step's scores on the host side

    def __init__(self, config: H2OConfig | None = None):
        super().__init__(config)
        self._states: dict[str, _State] = {}
        self._cache: CacheManager | None = None

    def bind(self, cache):
        self._cache = cache  # kept: import_state re-aligns scores with the attached table's positions

    def prefix_reuse_limit(self, num_prompt_tokens: int) -> int:
        return 0  # accumulated scores need every prompt token's attention

    def _state(self, req, num_layers: int) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # new, or recomputed after a preemption
            st = self._states[req.request_id] = _State(req, num_layers)
        return st

    def release(self, req) -> None:
        self._states.pop(req.request_id, None)

    def export_state(self, req):
        """``{"acc": [per layer [Hkv, n] fp32], "positions": [per layer [Hkv, n] int64]}`` or None."""
        st = self._states.get(req.request_id)
        if st is None or any(acc is None for acc in st.acc):
            return None
        return {"acc": list(st.acc), "positions": [st.positions(layer) for layer in range(len(st.acc))]}

    def import_state(self, req, state) -> None:
        """Called with the chain's table attached to ``req`` (before ``req.num_computed_tokens`` is set)."""
        cache = self._cache
        num_layers, heads = cache.spec.num_layers, cache.spec.num_kv_heads
        st = self._states[req.request_id] = _State(req, num_layers)
        st.base_logical = None  # the first step's start
        for layer in range(num_layers):
            target = cache.positions_of(req, layer)
            st.base_pos[layer] = target
            if state is None:
                st.acc[layer] = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
            else:
                st.acc[layer] = align_scores(state["positions"][layer], state["acc"][layer], target)
            assert st.acc[layer].shape == (heads, cache.physical_len(req, layer))

    def kv_loaded(self, req, cache) -> None:
        """Slots written outside a step (a benchmark's synthetic fill) received no attention: they join the
        accumulation with score 0."""
        num_layers, heads = cache.spec.num_layers, cache.spec.num_kv_heads
        st = self._state(req, num_layers)
        for layer in range(num_layers):
            acc, n = st.acc[layer], cache.physical_len(req, layer)
            old = 0 if acc is None else acc.shape[1]
            if n > old:
                pad = torch.zeros(heads, n - old, dtype=torch.float32, device=cache.spec.device)
                st.acc[layer] = pad if acc is None else torch.cat([acc, pad], dim=1)

    def accumulated(self, req, layer: int) -> torch.Tensor | None:
        """[Hkv, physical_len] accumulated attention of the request's slots in ``layer`` (for inspection)."""
        st = self._states.get(req.request_id)
        return None if st is None else st.acc[layer]

    def after_attention(self, layer, batch, out, scores):
        num_layers = batch.cache.spec.num_layers
        for req, n, received in zip(batch.requests, batch.num_new_tokens, scores):
            st = self._state(req, num_layers)
            if st.base_logical is None:
                st.base_logical = req.num_computed_tokens  # before the step's counts advance
            kv_len = received.shape[1]  # received: [Hkv, kv_len] attention per slot, this step's queries
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
            sizes = [cache.physical_len(req, layer) for layer in range(num_layers)]
            if max(sizes) <= cfg.budget:
                continue
            if length - n >= prompt:  # a decode step
                if not cfg.evict_every or (length - prompt) % cfg.evict_every:
                    continue
            st = self._state(req, num_layers)
            keep = []
            for acc, size in zip(st.acc, sizes):
                if size <= cfg.budget:
                    keep.append(keep_all(size, heads, device))
                    continue
                cut = size - cfg.recent_budget
                recent = torch.arange(cut, size, device=device).expand(heads, -1)
                keep.append(torch.cat([top_k_sorted(acc[:, :cut], cfg.heavy_budget), recent], dim=1))
            if cache.compact(req, keep):  # on failure: retried after the next step that allows eviction
                st.acc = [acc.gather(1, k) for acc, k in zip(st.acc, keep)]
                st.base_pos = [cache.positions_of(req, layer) for layer in range(num_layers)]
                st.base_logical = length
