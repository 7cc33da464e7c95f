"""Knorm eviction: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
(arXiv:2406.11430), Section 4 / the reference code's ``l2_compress``: a low key norm predicts high attention,
so the cache keeps, per (layer, KV head), the keys of smallest L2 norm and drops the others. Query-agnostic
(no attention is computed), so it needs no queries and no scores.

Definition implemented, per (layer l, KV head h), with B = ``budget``, r = ``recent``:

* ``norm[h, s] = ||k_s^h||_2`` of the key **as stored** (post-RoPE, and after the model's key norm where it
  has one, e.g. Qwen3), computed in fp32;
* when a layer holds n > B slots, KV head h keeps its last r slots (the r most recent positions: appended
  tokens sit at the end, and compaction preserves position order) plus the B - r slots of **smallest** norm
  among the other n - r (ties to the earlier position), in position order: exactly B slots. Each KV head has its
  own kept set; every compressed layer keeps the same count;
* layers in ``skip_layers`` are never compressed (the reference code's ``skip_layers``; its README example
  skips layers 0 and 1, its default skips none);
* when: in ``end_step`` after the step that computes the prompt's last token (the paper compresses the cache
  built from the prompt; earlier chunks of a long prefill are not compressed, so the prefill holds the whole
  prompt), and -- if ``evict_every = N > 0`` -- after every N-th generated token whose KV is cached, when a
  layer holds more than B + ``slack`` slots (``slack`` amortises the compaction copy; between such steps the
  cache grows by one slot per token).

Models with a key RMSNorm (Qwen3) give every key the norm ``||w * k / rms(k)||``, which depends on the key's
direction only through the norm weight w: the ranking is as informative as w is far from uniform (with unit
weights every key has norm sqrt(head_dim) and the ranking is decided by rounding).

``recent`` defaults to 0, the paper's and reference code's rule (no protected window); r > 0 is an extension
that shields the newest tokens from a norm-only decision.

A failed compaction (a shared page that cannot be replaced for lack of free pages) is retried: the prompt's
after every following step until it succeeds, a decode-time one at the next checkpoint. Prefix caching is
unaffected (the score is the stored key alone). The method has no per-layer hooks, so decode steps may replay
CUDA graphs (when every layer has the same length, i.e. without ``skip_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod
from engine.contract.method import DecodeCapabilities
from engine.errors import ConfigError
from engine.registry import register_method
from policies.scoring import check_int, keep_all, top_k_sorted


@dataclass(slots=True, frozen=True)
class KnormConfig:
    budget: int = 2048  # slots kept per (layer, KV head) once compressed, recent ones included
    recent: int = 0  # most recent slots always kept (0 = the paper's rule)
    evict_every: int = 0  # 0 = compress once after the prompt; N = also check every N generated tokens
    slack: int = 0  # decode-time compression only once a layer holds more than budget + slack slots
    skip_layers: tuple[int, ...] = ()  # layers never compressed

    def __post_init__(self) -> None:
        check_int("budget", self.budget, 1)
        check_int("recent", self.recent, 0)
        if self.recent > self.budget:
            raise ValueError(f"recent ({self.recent}) must be <= budget ({self.budget})")
        check_int("evict_every", self.evict_every, 0)
        check_int("slack", self.slack, 0)
        if isinstance(self.skip_layers, list):
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if not isinstance(self.skip_layers, tuple):
            raise ValueError(f"skip_layers must be a list of layer indices, got {self.skip_layers!r}")
        for layer in self.skip_layers:
            check_int("skip_layers entry", layer, 0)
        if len(set(self.skip_layers)) != len(self.skip_layers):
            raise ValueError(f"skip_layers has duplicates: {self.skip_layers!r}")


_ONE_STEP = DecodeCapabilities(window=1)  # end_step may act after this step


@register_method
class KnormEviction(SparseMethod):
    name = "knorm"
    family = Family.EVICTION
    Config = KnormConfig

    def __init__(self, config: KnormConfig | None = None):
        super().__init__(config)
        self._pending: set[str] = set()  # requests whose prompt compression has not succeeded yet

    def validate(self, spec):
        bad = [layer for layer in self.config.skip_layers if layer >= spec.num_layers]
        if bad:
            raise ConfigError(f"method 'knorm': skip_layers {bad} out of range for {spec.num_layers} layers")

    def release(self, req) -> None:
        self._pending.discard(req.request_id)

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """Only ``end_step`` acts, so every decode step may replay; a window lasts until ``end_step`` can act
        again: the prompt's compression is done, and the next check of ``evict_every`` is not inside it."""
        cfg = self.config
        if req.request_id in self._pending:
            return _ONE_STEP
        if not cfg.evict_every:
            return self.decode
        return DecodeCapabilities(
            window=max(1, cfg.evict_every - 1 - (req.num_computed_tokens - req.num_prompt_tokens) % cfg.evict_every))

    def end_step(self, batch):
        cfg = self.config
        cache = batch.cache
        for req in batch.finished_prompt:
            self._pending.add(req.request_id)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            length, prompt = req.num_computed_tokens, req.num_prompt_tokens
            if req.request_id in self._pending:
                if self._compress(req, cache, cfg.budget):
                    self._pending.discard(req.request_id)
            elif cfg.evict_every and length - n >= prompt and (length - prompt) % cfg.evict_every == 0:
                self._compress(req, cache, cfg.budget + cfg.slack)

    def _compress(self, req, cache, limit: int) -> bool:
        """Compress every layer holding more than ``limit`` slots down to the budget; False if compaction failed."""
        cfg = self.config
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        keep, changed = [], False
        for layer in range(cache.spec.num_layers):
            n = cache.physical_len(req, layer)
            if n <= limit or layer in cfg.skip_layers:
                keep.append(keep_all(n, heads, device))
                continue
            cut = n - cfg.recent
            keys = cache.table_keys(cache.table(req), layer)  # [n, Hkv, D]
            score = -keys[:cut].float().norm(dim=-1).T  # [Hkv, cut]: smaller norm, higher score
            top = top_k_sorted(score, cfg.budget - cfg.recent)
            keep.append(torch.cat([top, keep_all(n, heads, device)[:, cut:]], dim=1))
            changed = True
        return cache.compact(req, keep) if changed else True
