"""The method side of the lifecycle contract.

A ``SparseMethod`` decides which tokens a request keeps (eviction), which ones attention reads (selection)
and how they are stored (quantization, low rank). Every hook has a no-op default, so the base class *is* the
dense method: it keeps everything and reads everything. Subclasses live in ``policies/`` and register by name
(see ``engine.registry``); the engine calls the hooks and never names a method.

Order within one step::

    begin_step(batch)
      for each layer:  before_attention -> [cache.write] -> select -> [backend] -> after_attention -> end_layer
    end_step(batch)          # after sampling: batch.finished_prompt tells which requests just ended prefill
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.options import build_config
from engine.contract.view import PagedView

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.page_pool import PagePool
    from engine.request import Request


class Family(str, enum.Enum):
    DENSE = "dense"
    EVICTION = "eviction"
    SELECTION = "selection"
    QUANTIZATION = "quantization"
    LOWRANK = "lowrank"


@dataclass(slots=True, frozen=True)
class MethodNeeds:
    """What a method asks the runner to hand it beyond q/k/v and the view."""

    attention_scores: bool = False  # after_attention gets each request's probabilities [Hq, query_len, kv_len]
    # after_attention gets each request's [Hkv, kv_len] attention received per slot, summed over the step's
    # queries and the KV head's query heads (backends compute it without holding the probability matrices)
    received_attention: bool = False
    queries: bool = False
    raw_keys: bool = False


@dataclass(slots=True, frozen=True)
class NoConfig:
    pass


UNBOUNDED_WINDOW = 1 << 30  # DecodeCapabilities.window: no limit from the method


@dataclass(slots=True, frozen=True)
class DecodeCapabilities:
    """What the engine may do with a request's decode steps in place of calling the method's hooks on each.

    The engine never looks at which hooks a method overrides: each method class declares these
    (``SparseMethod.decode``; per request ``SparseMethod.decode_capabilities``), and the defaults are the dense
    method's.

    ``replay``: a pure-decode step may replay a captured CUDA graph. A replay runs attention over the step's
    view with no per-layer hook (``begin_step`` and ``end_step`` still run), so a method allows it only where
    its per-layer hooks would do nothing, or only device work the graphs captured (``graph_hooks``).

    ``graph_hooks``: on replayed steps the per-layer hooks are device work of fixed shapes that the decode
    graphs record (a selection computed inside the graph). Graphs captured with this very instance then serve
    its steps, and graphs captured with any other method do not.

    ``window``: how many of the request's next decode steps may run back to back on the device
    (``EngineConfig.decode_steps``). Inside a window ``begin_step`` and ``end_step`` are not called and the
    host's counts (computed tokens, token ids) advance only after it, so the step hooks must have nothing to do
    on those steps and the layer hooks only device work over the batch (each step's batch is built on the
    device; its scratch is fresh). A window (a single step too, under ``overlap_decode``) runs only where this
    is 2 or more; the next window is launched before the host reads the last only where it is
    ``UNBOUNDED_WINDOW`` (nothing the host learns from a window changes it).

    ``layer_output``: ``end_layer`` is called with each layer's output hidden states; without it the model need
    not form them.
    """

    replay: bool = True
    graph_hooks: bool = False
    window: int = UNBOUNDED_WINDOW
    layer_output: bool = False


# hooks that do host work on every step: no decode step replays a graph or runs in a window
HOOKS_EVERY_STEP = DecodeCapabilities(replay=False, window=1)


class SparseMethod:
    """A subclass whose hooks do work on decode steps declares what those steps may still do: ``decode``, and
    per request ``decode_capabilities``."""

    name: ClassVar[str] = "dense"
    family: ClassVar[Family] = Family.DENSE
    Config: ClassVar[type] = NoConfig
    needs: ClassVar[MethodNeeds] = MethodNeeds()
    view_types: ClassVar[tuple[type, ...]] = (PagedView,)  # every view type select() may return
    # the most its decode steps may ever do: an engine captures decode graphs for it only when ``replay``, and
    # ``graph_hooks`` / ``layer_output`` hold for every step. Dense: every step replays, windows are unbounded.
    decode: ClassVar[DecodeCapabilities] = DecodeCapabilities()

    def __init__(self, config: Any = None):
        self.config = config if config is not None else self.Config()

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> SparseMethod:
        """Build from user-supplied knobs; unknown knobs and bad values raise ConfigError."""
        return cls(build_config(cls.Config, options, f"method {cls.name!r}"))

    # --- representation -------------------------------------------------------------------------
    def make_cache(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool) -> CacheManager | None:
        """The cache of an engine whose configured method this is; None (the default): the engine's paged
        cache. A method that overrides it owns a layout of its own and cannot be chosen per request on an
        engine configured with another method."""
        return None

    def validate(self, spec: CacheSpec) -> None:
        """Raise ConfigError if this configuration cannot serve a model of ``spec`` (e.g. a layer index
        past the last layer). Runs once, when the engine takes the method on."""

    def bind(self, cache: CacheManager) -> None:
        """The engine hands the method the cache its requests live in (once, before any request)."""

    def prefix_reuse_limit(self, num_prompt_tokens: int) -> int:
        """The most prompt tokens a request may take from the prefix cache (the rest is computed). A method
        that needs the queries of a prompt's last tokens, or attention over the whole prompt, lowers it."""
        return num_prompt_tokens

    def resume_limit(self, num_prompt_tokens: int) -> int:
        """The most prompt tokens a chain turn may take from the chain's retained KV (the rest, at least the
        new tokens, is computed: retained tokens past the limit are dropped and recomputed, which leaves
        their KV as it was). A method that needs the queries of a prompt's last tokens lowers it, so it need
        not keep queries from one turn for the next."""
        return num_prompt_tokens

    def max_physical_tokens(self, num_prompt_tokens: int, max_new_tokens: int, max_chunk_tokens: int) -> int:
        """The most KV slots (per layer) a request may hold at once; admission reserves room for this much.
        Dense: every token. Methods that bound a request's KV override it (prefill chunks of up to
        ``max_chunk_tokens`` land before a step's eviction runs)."""
        return num_prompt_tokens + max_new_tokens

    # --- hooks (no-op defaults = dense) ---------------------------------------------------------
    def begin_step(self, batch: ForwardBatch) -> None:
        pass

    def before_attention(self, layer: int, batch: ForwardBatch) -> None:
        pass

    def select(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> PagedView:
        return batch.view_for(layer)

    def after_attention(
        self, layer: int, batch: ForwardBatch, out: torch.Tensor, scores: torch.Tensor | None
    ) -> None:
        pass

    def end_layer(self, layer: int, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """Called only when a method of the step declares ``decode.layer_output``."""

    def end_step(self, batch: ForwardBatch) -> None:
        pass

    def decode_capabilities(self, req: Request) -> DecodeCapabilities:
        """What ``req``'s next decode steps may do (never more than ``decode``). The engine asks it for every
        request of a pure-decode step (after ``begin_step``) whether the step may replay, and before launching a
        window how long it may be. Default: ``decode``. A method whose hooks matter for some requests or steps
        only answers per request (an eviction method done with a request: ``decode``; one that compresses
        periodically: replay and a window only while the next compression is further off)."""
        return self.decode

    def kv_loaded(self, req: Request, cache: CacheManager) -> None:
        """The cache wrote ``req``'s KV outside a forward step (a restore, a benchmark's synthetic fill):
        rebuild whatever metadata the method derives from written KV."""

    # --- cross-request state (Chain Cache, fork, offload) ---------------------------------------
    def export_state(self, req: Request) -> Any:
        return None

    def import_state(self, req: Request, state: Any) -> None:
        pass

    def release(self, req: Request) -> None:
        """The request is gone (finished, aborted or preempted): drop per-request method state."""
