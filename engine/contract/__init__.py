"""The lifecycle contract between the engine (mechanism) and sparse methods (policy)."""

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.method import Family, MethodNeeds, NoConfig, SparseMethod
from engine.contract.view import PagedView, SelectedPagesView, SelectedSlotsView, backend_can_read

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
    "backend_can_read",
]
