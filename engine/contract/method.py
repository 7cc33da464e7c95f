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


UNBOUNDED_WINDOW = 1 << 30  # max_decode_window: no limit from the method


class SparseMethod:
    """Subclasses that override a per-layer hook with host-side work must set ``cuda_graph_safe = False``."""

    name: ClassVar[str] = "dense"
    family: ClassVar[Family] = Family.DENSE
    Config: ClassVar[type] = NoConfig
    needs: ClassVar[MethodNeeds] = MethodNeeds()
    view_types: ClassVar[tuple[type, ...]] = (PagedView,)  # every view type select() may return
    cuda_graph_safe: ClassVar[bool] = True  # per-layer hooks do no host work, so decode steps may replay graphs
    # True when the per-layer hooks of its replayable steps are device work that the decode graphs capture
    # (a selection computed inside the graph): only graphs captured with this very instance then serve it
    graph_hooks: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.config = config if config is not None else self.Config()

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> SparseMethod:
        """Build from user-supplied knobs; unknown knobs and bad values raise ConfigError."""
        return cls(build_config(cls.Config, options, f"method {cls.name!r}"))

    # --- representation -------------------------------------------------------------------------
    def make_cache(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool) -> CacheManager:
        """The cache of an engine whose configured method this is. A method that overrides it owns a layout
        of its own and cannot be chosen per request on an engine configured with another method."""
        from engine.paged_cache import PagedCacheManager

        return PagedCacheManager(spec, pool, enable_prefix_caching=enable_prefix_caching)

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
        pass

    def end_step(self, batch: ForwardBatch) -> None:
        pass

    def replayable(self, batch: ForwardBatch) -> bool:
        """Whether this pure-decode step may replay a captured CUDA graph. A replay runs attention over the
        step's shared view with no per-layer hook (begin_step and end_step still run). A method that is not
        ``cuda_graph_safe`` in general may still allow it for steps where its per-layer hooks would do nothing
        (e.g. an eviction method that is done evicting), or, with ``graph_hooks``, for steps whose hooks are
        pure device work the graphs captured; overriding this makes the engine capture graphs."""
        return self.cuda_graph_safe

    STEP_HOOKS: ClassVar[tuple[str, ...]] = ("begin_step", "before_attention", "select", "after_attention",
                                             "end_layer", "end_step")

    @classmethod
    def is_hookless(cls) -> bool:
        """True when the class overrides none of the per-step and per-layer hooks: its decode steps are the
        model's forward alone, so several may run back to back on the device (``EngineConfig.decode_steps``)."""
        return all(getattr(cls, h) is getattr(SparseMethod, h) for h in SparseMethod.STEP_HOOKS)

    def max_decode_window(self, req: Request) -> int:
        """How many of this decoding request's next steps may run back to back on the device (``decode_steps``):
        ``begin_step``/``end_step`` are not called inside a window and the host-side counts (computed tokens,
        token ids) advance only after it, so the step hooks must have nothing to do on those steps and the
        layer hooks only device work over the batch (each step's batch is built on the device; its scratch
        is fresh). Default: unbounded when the method overrides no hook (``is_hookless``), else 1 (no
        window). A selection computed on the device from the batch answers unbounded; an eviction method
        whose request is evicted for good, unbounded; one that compresses periodically, the steps left
        before its hooks matter again. A window (a single step too, under ``overlap_decode``) runs only where
        this is 2 or more; the next one is launched before the host reads the last only where it is
        unbounded."""
        return UNBOUNDED_WINDOW if self.is_hookless() else 1

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
