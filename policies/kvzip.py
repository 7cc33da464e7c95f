"""KVzip: query-agnostic KV eviction scored by context reconstruction.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv:2505.23416).

Definition implemented, once a request's prompt (logical length P) is fully computed, with c = ``chunk_size``,
w = ``window`` and R = the tokens of ``repeat_prompt`` (the engine's tokenizer, no special tokens):

1. the context (the prompt's P tokens) is cut into chunks ``x_1, x_2, ...`` of c tokens; for each chunk the
   model is teacher-forced on ``R + x_i`` placed right after the prompt (logical positions P, P + 1, ...),
   attending to every slot the request holds plus its own earlier tokens (the engine's probe forward: nothing
   is committed);
2. ``score[l, h, s] = max over the reconstruction queries of every chunk and over the query heads j of KV
   head h (GQA) of softmax(q . k / sqrt(D))[s]`` -- the attention slot s receives;
3. the slots of the prompt's last w logical positions always stay (score +inf);
4. the target is ``b = budget`` slots per (layer, KV head) on average (``budget > 0``; a prompt of at most
   ``budget`` tokens is kept whole), else ``b = max(w, round(ratio * P))``; the ``b x layers x KV heads``
   globally highest scores (ties: earlier layer, head, slot) are selected across all layers and heads, so
   layers and heads get non-uniform budgets;
5. the cache stores one length per layer (all KV heads of a layer hold the same number of slots), so each
   layer keeps ``n_l = max over its heads of the selected count`` slots per head: every head keeps its top
   ``n_l`` slots by score (a superset of its selected ones; ties to the earlier slot).

Eviction runs in ``end_step`` after the step that finished the prompt (the first sampled token saw the whole
prompt); generated tokens are appended and never evicted. Chain turns: each turn's prompt-end eviction scores
what the request holds (the chain's compacted KV plus the new suffix) by reconstructing the turn's whole
prompt; since the score does not depend on any question, the compacted KV serves the later turns unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod, all_gather, tp_rank
from engine.contract.method import DecodeCapabilities
from engine.errors import ConfigError, InvalidRequestError
from engine.registry import register_method
from policies.scoring import check_int, top_k_sorted

DEFAULT_REPEAT_PROMPT = "Repeat the previous context:"
PROBE_ROWS = 512  # queries per probe forward: bounds the attention matrix, not the result


def reconstruction_scores(probe, table, logical_len: int, context_ids: list[int], repeat_ids: list[int],
                          chunk_size: int) -> list[torch.Tensor]:
    """Steps 1-2: per layer [Hkv, physical_len] the max attention each held slot receives while the model
    reconstructs ``context_ids`` chunk by chunk after ``repeat_ids``. Chunks shrink where the probe would pass
    the model's last position."""
    chunk_size = min(chunk_size, probe.max_positions - logical_len - len(repeat_ids))
    if chunk_size < 1:
        raise InvalidRequestError(f"no room after {logical_len} positions for a reconstruction probe")
    scores = None
    for lo in range(0, len(context_ids), chunk_size):
        ids = list(repeat_ids) + list(context_ids[lo: lo + chunk_size])
        part = probe.run(table, logical_len, ids, reduce="max", chunk_size=PROBE_ROWS)
        scores = part if scores is None else [torch.maximum(a, b) for a, b in zip(scores, part)]
    return scores


def global_keep(scores: list[torch.Tensor], per_head_budget: int) -> list[torch.Tensor]:
    """Steps 4-5: per layer [Hkv, n_l] kept slot indices (increasing) for the globally highest scores."""
    flat = torch.cat([s.flatten() for s in scores])
    total = per_head_budget * sum(s.shape[0] for s in scores)
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[torch.sort(flat, descending=True, stable=True).indices[:total]] = True
    keep, at = [], 0
    for s in scores:
        count = int(chosen[at: at + s.numel()].view(s.shape).sum(1).max())
        keep.append(top_k_sorted(s, count))
        at += s.numel()
    return keep


@dataclass(slots=True, frozen=True)
class KVzipConfig:
    ratio: float = 0.3  # kept share of the prompt per (layer, KV head) on average, when budget = 0
    budget: int = 0  # > 0: kept slots per (layer, KV head) on average, overrides ratio
    window: int = 8  # the prompt's last tokens, always kept
    chunk_size: int = 2048  # context tokens reconstructed per probe forward
    repeat_prompt: str = DEFAULT_REPEAT_PROMPT

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio must be a number in (0, 1], got {self.ratio!r}")
        check_int("budget", self.budget, 0)
        check_int("window", self.window, 1)
        check_int("chunk_size", self.chunk_size, 1)
        if self.budget and self.budget < self.window:
            raise ValueError(f"budget ({self.budget}) must be >= window ({self.window}): the window is always kept")
        if not isinstance(self.repeat_prompt, str):
            raise ValueError(f"repeat_prompt must be a str, got {type(self.repeat_prompt).__name__}")


_ONE_STEP = DecodeCapabilities(window=1)  # end_step may evict after this step


@register_method
class KVzip(SparseMethod):
    name = "kvzip"
    family = Family.EVICTION
    Config = KVzipConfig

    def __init__(self, config: KVzipConfig | None = None):
        super().__init__(config)
        self._pending: set[str] = set()  # prompt finished, eviction not done yet (a shared page was in the way)
        self._repeat_ids: list[int] | None = None

    def validate(self, spec) -> None:
        if spec.recurrent_layers:
            raise ConfigError("kvzip scores a prompt by a reconstruction probe run after it; a hybrid model's "
                              "recurrent layers keep no state to run that probe from")

    def per_head_budget(self, prompt_len: int) -> int | None:
        """Step 4's ``b``, or None when the prompt is kept whole."""
        cfg = self.config
        if cfg.budget:
            return None if prompt_len <= cfg.budget else cfg.budget
        b = max(cfg.window, round(cfg.ratio * prompt_len))
        return None if b >= prompt_len else b

    def release(self, req) -> None:
        self._pending.discard(req.request_id)

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """Only ``end_step`` acts, so every decode step may replay; a window once no eviction is pending (then
        ``end_step`` has nothing to evict)."""
        return _ONE_STEP if req.request_id in self._pending else self.decode

    def end_step(self, batch) -> None:
        for req in batch.finished_prompt:
            self._pending.add(req.request_id)
        for req in batch.requests:
            if req.request_id in self._pending and self._evict(req, batch):
                self._pending.discard(req.request_id)

    def _evict(self, req, batch) -> bool:
        """Score and compact ``req``; False if the compaction must be retried (a shared page)."""
        cfg, cache, probe = self.config, batch.cache, batch.probe
        prompt = req.num_prompt_tokens
        b = self.per_head_budget(prompt)
        num_layers = cache.spec.num_layers
        lens = [cache.physical_len(req, layer) for layer in range(num_layers)]
        if b is None or all(n <= b for n in lens):
            return True
        if probe is None:
            raise RuntimeError("kvzip scores with the engine's probe forward (ForwardBatch.probe), which is unset")
        if self._repeat_ids is None:
            self._repeat_ids = probe.encode(cfg.repeat_prompt)
        if req.num_computed_tokens + len(self._repeat_ids) >= probe.max_positions:
            return True  # no position left for a reconstruction after the prompt: keep it whole
        scores = reconstruction_scores(probe, cache.table(req), req.num_computed_tokens, req.token_ids[:prompt],
                                       self._repeat_ids, cfg.chunk_size)
        for layer, s in enumerate(scores):
            s.masked_fill_(cache.positions_of(req, layer) >= prompt - cfg.window, float("inf"))
        heads = scores[0].shape[0]  # this rank's KV heads; the global choice needs every rank's
        keep = global_keep([all_gather(s, 0) for s in scores], b)
        keep = [k[tp_rank() * heads:(tp_rank() + 1) * heads] for k in keep]
        if all(k.shape[1] == n for k, n in zip(keep, lens)):
            return True
        return cache.compact(req, keep)
