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

Sinks and window are defined by logical position (``positions_of``), per layer and KV head: the sinks are the
held slots at positions < ``sink_tokens`` (always the first slots of a row), the window the most recent held
slots, as many as bring the row to ``sink_tokens + window`` (exactly ``window`` unless some sink positions are
not held, e.g. pruned from a chain). Each layer is compacted when it exceeds the limit.

Chain turns (Chain Cache): nothing is per request, so a turn simply continues the stream. The request starts
with the chain's retained slots (already sink + recent window), its suffix is streamed through the window
chunk by chunk like any prompt, and its decode steps likewise; a chain is exactly the single request that
computed the whole history with the same schedule.

Positions: the paper re-assigns positions inside the cache (a sink's key is at position 0..s-1, the window
right after). The engine caches post-RoPE keys, so this implementation keeps every token's **original**
position (RoPE is never re-applied); queries use their true logical position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod
from engine.contract.method import DecodeCapabilities
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


def sink_and_window(positions: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[H, n] logical positions (rows increasing, n > sink + window) -> [H, sink + window] kept slot indices:
    each row's slots at positions < ``sink`` plus its most recent slots up to ``sink + window`` in all."""
    heads, n = positions.shape
    counts = (positions < sink).sum(dim=1).tolist()
    device = positions.device

    def row(c: int) -> torch.Tensor:
        return torch.cat([torch.arange(c, device=device), torch.arange(n - (sink + window - c), n, device=device)])

    if len(set(counts)) == 1:
        return row(counts[0]).expand(heads, -1)
    return torch.stack([row(c) for c in counts])


@register_method
class StreamingLLM(SparseMethod):
    name = "streaming_llm"

    def max_physical_tokens(self, num_prompt_tokens: int, max_new_tokens: int, max_chunk_tokens: int) -> int:
        """Sink + window + slack, plus one step's new tokens before its eviction runs."""
        c = self.config
        return c.sink_tokens + c.window + c.slack + max_chunk_tokens
    family = Family.EVICTION
    Config = StreamingLLMConfig

    def bind(self, cache) -> None:
        self._cache = cache

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """Only ``end_step`` acts, so every decode step may replay; a window lasts until the next compaction:
        ``end_step`` does nothing while every layer holds at most ``sink + window + slack`` slots."""
        c = self.config
        return DecodeCapabilities(window=max(1, c.sink_tokens + c.window + c.slack - self._cache.table(req).num_slots))

    def end_step(self, batch):
        cache = batch.cache
        sink, window = self.config.sink_tokens, self.config.window
        limit = sink + window + self.config.slack
        num_layers, heads, device = cache.spec.num_layers, cache.spec.num_kv_heads, cache.spec.device
        for req in batch.requests:
            sizes = [cache.physical_len(req, layer) for layer in range(num_layers)]
            if max(sizes) <= limit:
                continue
            keep = [sink_and_window(cache.positions_of(req, layer), sink, window) if n > limit
                    else torch.arange(n, device=device).expand(heads, n) for layer, n in enumerate(sizes)]
            cache.compact(req, keep)  # on failure: retried after the next step
