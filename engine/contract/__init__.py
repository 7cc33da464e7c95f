"""The lifecycle contract between the engine (mechanism) and sparse methods (policy)."""

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.method import Family, MethodNeeds, NoConfig, SparseMethod
from engine.contract.view import PagedView, SelectedPagesView, SelectedSlotsView, backend_can_read
from engine.parallel.state import all_gather, all_reduce, tp_rank, tp_world_size

# Tensor parallelism: each rank's cache and hooks see only its KV heads (and their query heads). A method whose
# score combines heads reduces it with ``all_reduce(t, "sum" | "max" | "mean")`` or ``all_gather`` so every
# rank selects what one rank holding all heads would; both are the identity at tensor_parallel_size 1.

__all__ = [
    "CacheManager",
    "CacheSpec",
    "Family",
    "MethodNeeds",
    "NoConfig",
    "PagedView",
    "SelectedPagesView",
    "SelectedSlotsView",
    "SparseMethod",
    "all_gather",
    "all_reduce",
    "backend_can_read",
    "tp_rank",
    "tp_world_size",
]
