"""R-KV: redundancy-aware decode-time KV compression for long (reasoning) generations.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (arXiv:2505.24133), Section 3 /
the reference code's ``R1KV._compute_scores``, ``compute_attention_scores`` and ``cal_similarity``
(github.com/Zefan-Cai/R-KV, ``rkv/``).

The cache of a request is a retained part of ``budget`` slots plus a buffer that fills with generated tokens;
once it holds ``budget + buffer`` slots it is compressed back to ``budget``. Definition implemented, per
(layer, KV head h), with a = ``alpha`` observation queries, n slots held (logical length L), m = n - a,
D = head_dim, G query heads per KV head (query head j reads KV head j // G), queries and keys post-RoPE:

1. **Observation window**: the queries of the last a computed tokens (positions [L - a, L)), which are also the
   last a slots of every head (compaction keeps them and keeps position order); they are always kept.
2. **Importance** of the m older slots s:
   ``z[h, i, s] = pool_{j in group(h)} (q_i^j . k_s^h / sqrt(D))`` -- the GQA group pooled on the *logits*
   (``gqa_pooling``: ``max``, the reference code's default, or ``mean``);
   ``A[h, i, s] = softmax_s z[h, i, s]`` over the m older slots only (the window's own keys excluded);
   ``I[h, s] = mean_i A[h, i, s]`` -- **mean** over the a observation queries; then 1D **max** pooling over
   slots (``kernel_size``, stride 1, padding ``kernel_size // 2``), as SnapKV.
3. **Redundancy** over all n keys of the head: ``k^ = k / (||k||_2 + 1e-8)``, ``S = k^ k^T`` (cosine
   similarity), ``S[s, s] = 0``; for each row s, the column ``r_s = max{t : S[s, t] > threshold}`` (the most
   recent key very similar to s, or 0 when there is none, exactly as the reference code's ``torch.max`` over
   zero-filled indices) gets ``S[s, r_s] = 0`` (the newest copy of a repeated token is spared on its account);
   ``R[h, t] = softmax_t(mean_s S[s, t])`` over the n columns (mean over all n rows), restricted to the m older
   slots.
4. ``score = mix_lambda * I - (1 - mix_lambda) * R``; KV head h keeps its ``budget - a`` older slots of largest
   score (ties to the earlier position) plus the a window slots: exactly ``budget`` per (layer, KV head).

When: in ``end_step`` after every step from the prompt's end on (the step computing the prompt's last token and
every decode step), a layer holding at least ``budget + buffer`` slots is compressed. In steady state that is
every ``buffer`` generated tokens (``budget`` -> ``budget + buffer``), so after any step a request holds at most
``budget + buffer - 1`` slots per layer (``budget + buffer`` while a step attends). The reference code also
requires the decoded count to cross a multiple of ``buffer``; dropping that alignment only moves the first
compression earlier (the reference can hold up to ``budget + 2 buffer - 1`` before it) and makes a prompt of at
least ``budget + buffer`` tokens compressed right after prefill instead of at the first aligned decode step.
Chunks of a long prefill are never compressed (decode-time method). ``mix_lambda`` defaults to the paper's 0.1
(the reference code's default is 0.07).

Prefix caching: the prompt's last ``alpha`` tokens are never reused from the prefix cache, so the
observation queries are always computed. Scale: ``head_dim ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod, reduce_over_query_heads
from engine.contract.method import HOOKS_EVERY_STEP, DecodeCapabilities
from engine.registry import register_method
from policies.scoring import (
    check_int, gather_keys, keep_all, pool1d, request_rows, top_k_sorted,
)

GQA_POOLINGS = ("max", "mean")


def _check_real(name: str, value, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")


@dataclass(slots=True, frozen=True)
class RKVConfig:
    budget: int = 512  # slots kept per (layer, KV head) after a compression, the observation window included
    buffer: int = 128  # generated tokens accumulated on top of the budget before compressing again
    alpha: int = 8  # observation queries (the most recent tokens), always kept
    mix_lambda: float = 0.1  # score = mix_lambda * importance - (1 - mix_lambda) * redundancy
    kernel_size: int = 7  # odd 1D max-pooling kernel over the importance; 1 = no pooling
    threshold: float = 0.5  # cosine similarity above which the most recent similar key is spared
    gqa_pooling: str = "max"  # "max" | "mean" over a KV head's query heads, on the logits

    def __post_init__(self) -> None:
        check_int("alpha", self.alpha, 1)
        check_int("budget", self.budget, 1)
        if self.budget <= self.alpha:
            raise ValueError(f"budget ({self.budget}) must be > alpha ({self.alpha}): the window is always kept")
        check_int("buffer", self.buffer, 1)
        _check_real("mix_lambda", self.mix_lambda, 0.0, 1.0)
        check_int("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same-length pooling), got {self.kernel_size}")
        _check_real("threshold", self.threshold, -1.0, 1.0)
        if self.gqa_pooling not in GQA_POOLINGS:
            raise ValueError(f"gqa_pooling must be one of {GQA_POOLINGS}, got {self.gqa_pooling!r}")


def importance(q: torch.Tensor, keys: torch.Tensor, kernel_size: int, gqa_pooling: str) -> torch.Tensor:
    """q [a, Hq, D] observation queries, keys [m, Hkv, D] the older slots -> fp32 [Hkv, m] (step 2)."""
    a, hq, d = q.shape
    m, hkv, _ = keys.shape
    logits = torch.einsum("ihgd,shd->hgis", q.float().reshape(a, hkv, hq // hkv, d), keys.float()) * d**-0.5
    z = logits.amax(dim=1) if gqa_pooling == "max" else logits.mean(dim=1)  # [Hkv, a, m]
    z = reduce_over_query_heads(z, gqa_pooling)
    return pool1d(torch.softmax(z, dim=-1).mean(dim=1), kernel_size, "max")


def redundancy(keys: torch.Tensor, threshold: float, max_elements: int = 2**26) -> torch.Tensor:
    """keys [n, Hkv, D] -> fp32 [Hkv, n] (step 3). The [Hkv, n, n] similarity is never held whole: rows go in
    chunks of at most ``max_elements`` entries (the column means need only running sums), so a long prompt's
    first compression costs O(n^2) time but O(n) memory per row chunk."""
    k = keys.float().transpose(0, 1)  # [Hkv, n, D]
    heads, n = k.shape[:2]
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    col_sum = torch.zeros(heads, n, dtype=torch.float32, device=k.device)
    rows = max(1, max_elements // max(heads * n, 1))
    for s0 in range(0, n, rows):
        s1 = min(n, s0 + rows)
        sim = unit[:, s0:s1] @ unit.transpose(1, 2)  # [Hkv, c, n]
        idx = torch.arange(s0, s1, device=k.device)
        sim[:, idx - s0, idx] = 0.0  # the diagonal
        over = sim > threshold
        last = n - 1 - over.flip(-1).to(torch.uint8).argmax(dim=-1)  # the most recent similar key of each row
        spared = torch.where(over.any(dim=-1), last, torch.zeros_like(last))  # [Hkv, c]; 0 when there is none
        sim.scatter_(-1, spared[..., None], 0.0)
        col_sum += sim.sum(dim=1)
    return torch.softmax(col_sum / n, dim=-1)


class RollingQueries:
    """The last ``size`` query rows a request computed, per layer, with their logical positions."""

    __slots__ = ("size", "q", "pos")

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.q: list[torch.Tensor | None] = [None] * num_layers
        self.pos: list[torch.Tensor | None] = [None] * num_layers

    def push(self, layer: int, rows: torch.Tensor, first_pos: int) -> None:
        q = rows.detach().clone()
        p = torch.arange(first_pos, first_pos + rows.shape[0], device=rows.device)
        if self.q[layer] is not None:
            q, p = torch.cat([self.q[layer], q]), torch.cat([self.pos[layer], p])
        self.q[layer], self.pos[layer] = q[-self.size:], p[-self.size:]

    def rows_between(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stashed rows with logical position in [lo, hi) and those positions (None, None if none)."""
        p = self.pos[layer]
        if p is None:
            return None, None
        sel = (p >= lo) & (p < hi)
        return self.q[layer][sel], p[sel]


class _State:
    __slots__ = ("preemptions", "queries")

    def __init__(self, req, num_layers: int, alpha: int):
        self.preemptions = req.num_preemptions
        self.queries = RollingQueries(num_layers, alpha)  # the last `alpha` computed queries of each layer


@register_method
class RKV(SparseMethod):
    name = "rkv"

    def max_physical_tokens(self, num_prompt_tokens: int, max_new_tokens: int, max_chunk_tokens: int) -> int:
        """The whole prompt, then at most ``budget + buffer`` slots once generation compresses."""
        return max(num_prompt_tokens + 1, self.config.budget + self.config.buffer)
    family = Family.EVICTION
    Config = RKVConfig
    # select stashes the observation queries on the host side: see ``decode_capabilities`` for the steps it need not

    def __init__(self, config: RKVConfig | None = None):
        super().__init__(config)
        self._states: dict[str, _State] = {}

    def prefix_reuse_limit(self, num_prompt_tokens: int) -> int:
        return max(0, num_prompt_tokens - self.config.alpha)  # the observation queries are always computed

    def _state(self, req, num_layers: int) -> _State:
        st = self._states.get(req.request_id)
        if st is None or st.preemptions != req.num_preemptions:  # new, or recomputed after a preemption
            st = self._states[req.request_id] = _State(req, num_layers, self.config.alpha)
        return st

    def release(self, req) -> None:
        self._states.pop(req.request_id, None)

    def bind(self, cache) -> None:
        self._cache = cache

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """A decode step's queries are read only by a compression within the next ``alpha`` steps (the window
        is the last ``alpha`` computed tokens): while the longest layer holds fewer than ``budget + buffer -
        alpha`` slots a step needs no stash and no compression follows it, so it may replay a decode graph
        (``buffer - alpha`` of every ``buffer`` steps in steady state), and a window runs the steps before the
        stash matters again."""
        cfg = self.config
        if req.num_computed_tokens < req.num_prompt_tokens:
            return HOOKS_EVERY_STEP
        room = cfg.budget + cfg.buffer - cfg.alpha - self._cache.table(req).num_slots  # the longest layer's slots
        return DecodeCapabilities(replay=room > 0, window=max(1, room))

    # --- hooks ------------------------------------------------------------------------------------
    def select(self, layer, q, batch):
        a = self.config.alpha
        num_layers = batch.cache.spec.num_layers
        for req, row, n, first in request_rows(batch):
            lo = max(first, first + n - a, req.num_prompt_tokens - a)
            if lo < first + n:
                self._state(req, num_layers).queries.push(layer, q[row + lo - first: row + n], lo)
        return batch.view_for(layer)

    def end_step(self, batch):
        cfg = self.config
        cache = batch.cache
        limit = cfg.budget + cfg.buffer
        for req in batch.requests:
            if req.num_computed_tokens < req.num_prompt_tokens:
                continue
            if max(cache.physical_len(req, layer) for layer in range(cache.spec.num_layers)) >= limit:
                self._compress(req, self._state(req, cache.spec.num_layers), cache)

    # --- compression ------------------------------------------------------------------------------
    def _compress(self, req, st: _State, cache) -> None:
        cfg = self.config
        a, length = cfg.alpha, req.num_computed_tokens
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        keep = []
        for layer in range(cache.spec.num_layers):
            n = cache.physical_len(req, layer)
            if n < cfg.budget + cfg.buffer:
                keep.append(keep_all(n, heads, device))
                continue
            q, q_pos = st.queries.rows_between(layer, length - a, length)
            if q is None or q.shape[0] < a:
                return  # the window's queries were not all computed here (a resumed chain): retried next step
            k_pos = cache.positions_of(req, layer)
            assert torch.equal(k_pos[:, n - a:], q_pos.expand(heads, a)), "the window is not the last slots"
            keys = gather_keys(cache, req, layer, n)
            m = n - a
            score = (cfg.mix_lambda * importance(q, keys[:m], cfg.kernel_size, cfg.gqa_pooling)
                     - (1 - cfg.mix_lambda) * redundancy(keys, cfg.threshold)[:, :m])
            top = top_k_sorted(score, cfg.budget - a)
            keep.append(torch.cat([top, keep_all(n, heads, device)[:, m:]], dim=1))
        cache.compact(req, keep)  # on failure: retried after the next step
