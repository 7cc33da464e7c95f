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

Chain turns (Chain Cache). A turn's prompt is the chain's whole history plus the new tokens (logical length
P); the request starts with the chain's retained KV, possibly already compacted by earlier turns, and
prefills only the suffix. Each turn is one application of the definition above, at the end of *its* prompt,
over what the request physically holds:

* the window is again the queries of logical positions [P - w, P). The turn computes them itself: its
  ``resume_limit`` (P - w) makes the chain cut its retained KV back to the window's start and recompute
  those tokens (their KV comes out as it was: the same tokens over the same retained KV). Retained KV can
  only be cut after its last compaction; when the window starts before it, its earlier rows are the previous
  prompt's last queries, which the request stashes per layer during prefill and ``export_state`` /
  ``import_state`` carry with the chain. Rows that are neither (tokens generated before a prune compacted
  the chain, or a lost method state) are left out of the vote;
* the keys are every slot the layer holds (the retained, possibly compacted KV plus the new suffix) at their
  logical positions (``positions_of``); causality inside the window is by logical position;
* the window slots are the held slots at positions >= P - w (all w of them unless the chain was pruned);
  pooling runs over the other slots in slot order, and each (layer, KV head) holding more than its budget
  keeps its window slots plus its top ``budget - |window|`` other slots. Layers at or under their budget, and
  turns whose P is at most ``budget``, keep everything.

The first turn of a chain (and any recomputed one) is exactly the single-request case. Decode queries are
stashed only under ``reeval_every`` (the rolling last w); otherwise decode steps run no per-layer hook once
the prompt is evicted and replay CUDA graphs, chain turns included.

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
from torch.profiler import record_function

from engine.contract import Family, SparseMethod
from engine.contract.method import HOOKS_EVERY_STEP
from engine.registry import register_method
from policies.scoring import (
    POOLINGS,
    QueryStash,
    WindowVoter,
    check_int,
    held_window_scores,
    keep_all,
    keep_top_and_window,
    keep_voted_and_window,
    request_rows,
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

    def __init__(self, req, num_layers: int, window: int, queries: QueryStash | None = None):
        self.preemptions = req.num_preemptions
        self.queries = QueryStash(num_layers, window) if queries is None else queries  # the last w computed
        self.prompt_evicted = False  # this turn's prompt-end eviction is done
        self.budgets: list[int] | None = None


@register_method
class SnapKV(SparseMethod):
    name = "snapkv"
    family = Family.EVICTION
    Config = SnapKVConfig
    # select stashes window queries on the host; a request's decode steps replay graphs and run in windows only
    # once nothing needs them (see ``decode_capabilities``)

    def __init__(self, config: SnapKVConfig | None = None):
        super().__init__(config)
        self._states: dict[str, _State] = {}

    def prefix_reuse_limit(self, num_prompt_tokens: int) -> int:
        return max(0, num_prompt_tokens - self.config.window)  # the window's queries are always computed

    def layer_budgets(self, num_layers: int, prompt_len: int) -> list[int]:
        """Kept slots per layer (window included) for a prompt of ``prompt_len`` tokens."""
        return [self.config.budget] * num_layers

    # --- state ------------------------------------------------------------------------------------
    def _state(self, req, num_layers: int) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # new, or recomputed after a preemption
            st = self._states[req.request_id] = _State(req, num_layers, self.config.window)
        return st

    def release(self, req) -> None:
        self._states.pop(req.request_id, None)

    def export_state(self, req):
        """The request's last ``window`` queries per layer: ``{"queries": [(first position, [k, Hq, D])]}``."""
        st = self._states.get(req.request_id)
        return None if st is None else {"queries": st.queries.export()}

    def import_state(self, req, state) -> None:
        self._states.pop(req.request_id, None)
        if state is not None:
            queries = QueryStash.load(state["queries"], self.config.window)
            self._states[req.request_id] = _State(req, len(queries.q), self.config.window, queries)

    resume_limit = prefix_reuse_limit  # a chain turn recomputes its whole window too

    def _done(self, req) -> bool:
        """No later vote can read this request's next queries: its prompt is evicted and no re-evaluation is
        configured (a later chain turn recomputes its window: ``resume_limit``)."""
        st = self._states.get(req.request_id)
        return (st is not None and st.prompt_evicted and st.preemptions == req.num_preemptions
                and not self.config.reeval_every)

    def decode_capabilities(self, req):
        return self.decode if self._done(req) else HOOKS_EVERY_STEP  # done: select stashes, end_step evicts nothing

    # --- hooks ------------------------------------------------------------------------------------
    def select(self, layer, q, batch):
        w = self.config.window
        num_layers = batch.cache.spec.num_layers
        for req, row, n, first in request_rows(batch):
            if self._done(req):
                continue
            st = self._state(req, num_layers)
            # the last w computed rows, and until the prompt-end eviction succeeds every row of its window
            keep_from = None if st.prompt_evicted else req.num_prompt_tokens - w
            lo = first + n - w if keep_from is None else min(first + n - w, keep_from)
            skip = max(0, lo - first)
            st.queries.push(layer, q[row + skip: row + n], first + skip, keep_from)
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
                self._trim(req, st, cache, length)  # on failure the next re-evaluation tries again

    # --- eviction ---------------------------------------------------------------------------------
    def _evict_prompt(self, req, st: _State, cache) -> None:
        prompt = req.num_prompt_tokens
        st.budgets = self.layer_budgets(cache.spec.num_layers, prompt)
        if prompt <= self.config.budget or self._trim(req, st, cache, prompt):
            st.prompt_evicted = True  # else: a shared page could not be replaced; retried next step

    def _trim(self, req, st: _State, cache, end: int) -> bool:
        """Vote with the queries of logical positions [end - w, end) over every held slot and bring each layer
        holding more than its budget back to it. False if the compaction failed.

        Layers whose window rows are their last slots (a prompt's end, a chain turn that recomputed its window)
        and hold as many slots, window slots and budget vote together through ``WindowVoter.sums_of_layers`` (on
        a GPU three kernels for all of them) and select together: one pooling and one top-k over all of them."""
        cfg = self.config
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        lo = end - cfg.window
        keep: list[torch.Tensor | None] = [None] * len(st.budgets)
        changed, voter = False, WindowVoter(cache, req)
        grouped: dict[tuple[int, int, int], list[tuple[int, torch.Tensor]]] = {}
        with record_function("snapkv.vote"):  # named ranges: benchmarks.chain_turn_profile splits a turn by them
            for layer, budget in enumerate(st.budgets):
                n = cache.physical_len(req, layer)
                if n <= budget:
                    keep[layer] = keep_all(n, heads, device)
                    continue
                changed = True
                q = st.queries.rows(layer, lo, end)
                q_first = st.queries.first_between(layer, lo, end)
                slot, pos = cache.table(req).ordered_from(layer)
                if voter.causal_order(layer, n, q.shape[0], q_first, (slot, pos)) and lo >= pos:
                    window = max(0, min(n - slot, n - slot - (lo - pos)))  # the window slots, told on the host
                    grouped.setdefault((n, window, budget), []).append((layer, q))
                    continue
                q_pos = torch.arange(q_first, q_first + q.shape[0], device=q.device)
                k_pos = cache.positions_of(req, layer)
                vote = held_window_scores(cache, req, layer, q, q_pos, k_pos, q_first)
                keep[layer] = keep_voted_and_window(vote, k_pos, lo, budget, cfg.kernel_size, cfg.pooling,
                                                    (slot, pos))
            for (n, window, budget), layers in grouped.items():
                sums = voter.sums_of_layers([layer for layer, _ in layers], [q for _, q in layers], n)
                vote = WindowVoter.finish(sums, layers[0][1]).flatten(0, 1)
                kept = keep_top_and_window(vote, window, budget, cfg.kernel_size, cfg.pooling)
                for (layer, _), k in zip(layers, kept.view(len(layers), heads, budget)):
                    keep[layer] = k
        if not changed:
            return True
        with record_function("snapkv.compact"):
            return cache.compact(req, keep)
