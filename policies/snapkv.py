"""SnapKV: prompt-time KV eviction voted by an observation window.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469), Listing 1 / the reference code's ``SnapKVCluster.update_kv``.

Definition implemented, per layer, once the prompt (length P) is fully computed and only if P > ``budget``
(with w = ``window``, queries and keys post-RoPE, D = head_dim, g = query heads per KV head):

1. the observation window is the queries of the prompt's last w positions [P - w, P);
2. ``A[j, i, s] = softmax_s(q_i^j . k_s^{j//g} / sqrt(D))`` over all P prompt keys, causal inside the window
   (window query i does not see window keys after it);
3. ``vote[h, s] = mean_{j in group(h)} sum_i A[j, i, s]`` -- summed over the window queries, then **averaged
   over the g query heads that share KV head h** (GQA: one kept set per KV head, the cache stores KV heads);
4. the prefix part ``vote[h, :P - w]`` is pooled with 1D ``pooling`` (``max`` or ``avg``; kernel
   ``kernel_size``, stride 1, padding ``kernel_size // 2``; avg counts padding as zeros);
5. each KV head keeps its top ``budget - w`` prefix positions by pooled vote (ties to the earlier position)
   plus the whole window: exactly ``budget`` slots per (layer, KV head).

Eviction runs in ``end_step`` after the step that finished the prompt, so the first sampled token was computed
with full attention; every later token attends only to the kept slots plus the tokens generated since.
A prompt of at most ``budget`` tokens is kept whole (no compaction).

``reeval_every = N > 0`` (an extension, off by default): after every N generated tokens, the same vote is
recomputed with the last w computed queries (the rolling observation window, logical positions
[L - w, L)) against the currently kept keys (causal by logical position), and each layer whose physical
length exceeds its budget keeps its top ``budget - w`` non-window slots plus the window's w slots.

Prefix caching: the cache manager never reuses the prompt's last ``window`` tokens from the prefix cache,
so the observation window's queries are always computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod
from engine.registry import register_method
from policies.scoring import (
    POOLINGS,
    QueryStash,
    WindowPreservingCache,
    check_int,
    gather_keys,
    keep_all,
    pool1d,
    request_rows,
    top_k_sorted,
    window_scores,
)


@dataclass(slots=True, frozen=True)
class SnapKVConfig:
    budget: int = 2048  # kept slots per (layer, KV head), the window included
    window: int = 32  # observation queries at the end of the prompt
    kernel_size: int = 7  # odd pooling kernel; 1 = no pooling
    pooling: str = "max"  # "max" | "avg"
    reeval_every: int = 0  # 0 = evict once after the prompt; N = also re-evict every N generated tokens

    def __post_init__(self) -> None:
        check_int("window", self.window, 1)
        check_int("budget", self.budget, 1)
        if self.budget < self.window:
            raise ValueError(f"budget ({self.budget}) must be >= window ({self.window}): the window is always kept")
        check_int("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same-length pooling), got {self.kernel_size}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_int("reeval_every", self.reeval_every, 0)


class _State:
    __slots__ = ("preemptions", "queries", "prompt_evicted", "budgets")

    def __init__(self, req, num_layers: int):
        self.preemptions = req.num_preemptions
        self.queries: QueryStash | None = QueryStash(num_layers)
        self.prompt_evicted = False
        self.budgets: list[int] | None = None


@register_method
class SnapKV(SparseMethod):
    name = "snapkv"
    family = Family.EVICTION
    Config = SnapKVConfig
    # select stashes window queries on the host. Even with reeval_every = 0 a replayed pure-decode step can
    # hold a request's 1-token final prompt chunk, whose query the window needs, so no decode graphs.
    cuda_graph_safe = False

    def __init__(self, config: SnapKVConfig | None = None):
        super().__init__(config)
        self._states: dict[str, _State] = {}

    def make_cache(self, spec, pool, enable_prefix_caching):
        return WindowPreservingCache(spec, pool, enable_prefix_caching, reserve=self.config.window)

    def layer_budgets(self, num_layers: int, prompt_len: int) -> list[int]:
        """Kept slots per layer (window included) for a prompt of ``prompt_len`` tokens."""
        return [self.config.budget] * num_layers

    # --- state ------------------------------------------------------------------------------------
    def _state(self, req, num_layers: int) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # new, or recomputed after a preemption
            st = self._states[req.request_id] = _State(req, num_layers)
        return st

    def release(self, req) -> None:
        self._states.pop(req.request_id, None)

    # --- hooks ------------------------------------------------------------------------------------
    def select(self, layer, q, batch):
        w = self.config.window
        num_layers = batch.cache.spec.num_layers
        for req, row, n, first in request_rows(batch):
            st = self._state(req, num_layers)
            if not st.prompt_evicted:
                lo = max(first, req.num_prompt_tokens - w)  # every row from the window's start on
                if lo < first + n:
                    st.queries.push(layer, q[row + lo - first: row + n], lo)
            elif self.config.reeval_every:
                lo = max(first, first + n - w)
                st.queries.push(layer, q[row + lo - first: row + n], lo, keep_last=w)
        return batch.view_for(layer)

    def end_step(self, batch):
        cache = batch.cache
        num_layers = cache.spec.num_layers
        every = self.config.reeval_every
        for req in batch.requests:
            st = self._state(req, num_layers)
            length, prompt = req.num_computed_tokens, req.num_prompt_tokens
            if not st.prompt_evicted:
                if length >= prompt:
                    self._evict_prompt(req, st, cache)
            elif every and length > prompt and (length - prompt) % every == 0:
                self._reevaluate(req, st, cache)

    # --- eviction ---------------------------------------------------------------------------------
    def _finish_prompt(self, st: _State) -> None:
        st.prompt_evicted = True
        if self.config.reeval_every:
            st.queries.trim(self.config.window)
        else:
            st.queries = None

    def _evict_prompt(self, req, st: _State, cache) -> None:
        cfg = self.config
        prompt, w = req.num_prompt_tokens, cfg.window
        num_layers, heads, device = cache.spec.num_layers, cache.spec.num_kv_heads, cache.spec.device
        st.budgets = self.layer_budgets(num_layers, prompt)
        if prompt <= cfg.budget:
            self._finish_prompt(st)
            return
        keep = []
        k_pos = torch.arange(prompt, device=device).expand(heads, prompt)
        for layer, budget in enumerate(st.budgets):
            n = cache.physical_len(req, layer)  # == the logical length: nothing was evicted yet
            if budget >= prompt:
                keep.append(keep_all(n, heads, device))
                continue
            q, q_pos = st.queries.rows_between(layer, prompt - w, prompt)
            assert q.shape[0] == w, "the observation window's queries were not all computed"
            vote = window_scores(q, gather_keys(cache, req, layer, prompt), q_pos, k_pos)
            pooled = pool1d(vote[:, : prompt - w], cfg.kernel_size, cfg.pooling)
            top = top_k_sorted(pooled, budget - w)
            keep.append(torch.cat([top, keep_all(n, heads, device)[:, prompt - w:]], dim=1))
        if cache.compact(req, keep):  # else: a shared page could not be replaced; retried next step
            self._finish_prompt(st)

    def _reevaluate(self, req, st: _State, cache) -> None:
        cfg = self.config
        w, length = cfg.window, req.num_computed_tokens
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        keep, changed = [], False
        for layer, budget in enumerate(st.budgets):
            n = cache.physical_len(req, layer)
            if n <= budget:
                keep.append(keep_all(n, heads, device))
                continue
            q, q_pos = st.queries.rows_between(layer, length - w, length)
            k_pos = cache.positions_of(req, layer)
            assert q.shape[0] == w and torch.equal(k_pos[:, n - w:], q_pos.expand(heads, w))
            vote = window_scores(q, gather_keys(cache, req, layer, n), q_pos, k_pos)
            pooled = pool1d(vote[:, : n - w], cfg.kernel_size, cfg.pooling)
            top = top_k_sorted(pooled, budget - w)
            keep.append(torch.cat([top, keep_all(n, heads, device)[:, n - w:]], dim=1))
            changed = True
        if changed:
            cache.compact(req, keep)  # on failure the next re-evaluation tries again
