"""The lifecycle contract between the engine (mechanism) and sparse methods (policy)."""

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.method import (HOOKS_EVERY_STEP, UNBOUNDED_WINDOW, DecodeCapabilities, Family, MethodNeeds,
                                    NoConfig, SparseMethod)
from engine.contract.storage import KVStorage, TableHandle
from engine.contract.view import PagedView, SelectedPagesView, SelectedSlotsView, backend_can_read
from engine.parallel.state import (all_gather, all_reduce, query_head_ranks, reduce_over_query_heads, tp_rank,
                                   tp_world_size)
from engine.request import Request  # what every hook is handed: read its ids and counts, never write them

# Tensor parallelism: each rank's cache and hooks see only its KV heads (and their query heads). A method whose
# score combines heads reduces it with ``all_reduce(t, "sum" | "max" | "mean")`` or ``all_gather`` so every
# rank selects what one rank holding all heads would; both are the identity at tensor_parallel_size 1. Under latent
# attention every rank holds the one KV head and a slice of its query heads: a score pooled over a KV head's query
# heads is completed with ``reduce_over_query_heads(t, op)`` (the identity where ranks hold whole KV heads).

__all__ = [
    "CacheManager",
    "CacheSpec",
    "DecodeCapabilities",
    "Family",
    "HOOKS_EVERY_STEP",
    "KVStorage",
    "MethodNeeds",
    "NoConfig",
    "PagedView",
    "Request",
    "SelectedPagesView",
    "SelectedSlotsView",
    "SparseMethod",
    "TableHandle",
    "UNBOUNDED_WINDOW",
    "all_gather",
    "all_reduce",
    "backend_can_read",
    "query_head_ranks",
    "reduce_over_query_heads",
    "tp_rank",
    "tp_world_size",
]
