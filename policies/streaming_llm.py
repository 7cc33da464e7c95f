"""StreamingLLM: attention sinks plus a sliding window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv:2309.17453).

Definition implemented: every request keeps, in every layer and KV head, the first ``sink_tokens`` logical
positions (the attention sinks) and the most recent ``window`` positions. Eviction runs in ``end_step``
after prompt chunks and decode steps alike, for every request of the step: once the physical length exceeds
``sink_tokens + window + slack`` the request is compacted back to exactly ``sink_tokens + window`` slots.
``slack`` amortises compaction (each one copies the kept slots); with ``slack = 0`` the cache never holds
more than ``sink_tokens + window`` tokens between steps, as in the paper. Tokens computed in one step see the
kept set as of the step's start plus the step's own earlier tokens, so a long prompt is streamed chunk by
chunk through the same window.

Positions: the paper re-assigns positions inside the cache (a sink's key is at position 0..s-1, the window
right after). The engine caches post-RoPE keys, so this implementation keeps every token's **original**
position (RoPE is never re-applied); queries use their true logical position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod
from engine.registry import register_method
from policies.scoring import check_int


@dataclass(slots=True, frozen=True)
class StreamingLLMConfig:
    sink_tokens: int = 4  # first positions always kept
    window: int = 1020  # most recent positions kept
    slack: int = 16  # extra tokens tolerated before compacting (amortises the copy)

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window", self.window, 1)
        check_int("slack", self.slack, 0)


@register_method
class StreamingLLM(SparseMethod):
    name = "streaming_llm"
    family = Family.EVICTION
    Config = StreamingLLMConfig

    def end_step(self, batch):
        cache = batch.cache
        sink, window = self.config.sink_tokens, self.config.window
        limit = sink + window + self.config.slack
        heads, device = cache.spec.num_kv_heads, cache.spec.device
        for req in batch.requests:
            n = cache.physical_len(req, 0)  # every layer has the same length under this method
            if n <= limit:
                continue
            keep = torch.cat([torch.arange(sink, device=device), torch.arange(n - window, n, device=device)])
            keep = keep.expand(heads, -1)
            cache.compact(req, [keep] * cache.spec.num_layers)  # on failure: retried after the next step
