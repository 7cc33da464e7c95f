"""The cache-manager side of the lifecycle contract.

A method owns its KV representation through a ``CacheManager``. The scheduler asks it for memory (pages come
from the one shared ``PagePool`` so admission sees real memory); the runner asks it where new tokens go and
which view a step's attention reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.contract.storage import KVStorage, TableHandle
    from engine.contract.view import PagedView
    from engine.request import Request


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """What one token's KV looks like for this model (a property of the model's attention layers)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    page_size: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def v_head_dim(self) -> int:
        """The width of a value row (a latent cache's values are narrower than its keys)."""
        return self.head_dim

    @property
    def prefix_reusable(self) -> bool:
        """Whether a request may start from another's published pages (False where per-request state that the
        pages do not hold must be at the prefix's end: a hybrid model's recurrent layers)."""
        return True

    @property
    def recurrent_layers(self) -> int:
        """Layers of the model whose state is per request rather than per token (not in ``num_layers``)."""
        return 0

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def window_bytes(self) -> int:
        """Bytes held beside the pages out of the same budget (a codec's full-precision windows); none here."""
        return 0


class CacheManager(ABC):
    """Per-request KV bookkeeping plus the storage behind it.

    Lengths are physical (slots held); a request's logical length is ``Request.num_computed_tokens``.
    """

    spec: CacheSpec
    page_size: int
    storage: KVStorage  # the bytes behind the pages and how a token is stored (engine.contract.storage)

    # --- scheduler side -------------------------------------------------------------------------
    @property
    def prefill_alignment(self) -> int:
        """A prefill chunk that does not end its prompt ends on a multiple of this many tokens where it can
        (1: anywhere)."""
        return 1

    @abstractmethod
    def match_prefix(self, req: Request) -> int:
        """Attach cached pages for the longest reusable prefix; returns tokens reused (0 if none)."""

    @abstractmethod
    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Reserve room for ``num_new_tokens`` more tokens; False (nothing changed) if the pool is short."""

    @abstractmethod
    def free(self, req: Request) -> None:
        """Give back everything the request holds (its full pages stay matchable in the prefix index)."""

    @abstractmethod
    def commit(self, req: Request, num_new_tokens: int) -> None:
        """Called after a step computed ``num_new_tokens`` for ``req``: advance lengths, publish full pages."""

    @abstractmethod
    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        """Pages ``allocate(req, num_new_tokens)`` would take from the pool."""

    @abstractmethod
    def num_pages_held(self, req: Request) -> int: ...

    # --- state that outlives a request (Chain Cache): an opaque per-request table ----------------
    @abstractmethod
    def holds(self, req: Request) -> bool: ...

    @abstractmethod
    def detach(self, req: Request) -> TableHandle | None:
        """Take the request's state out without freeing it; None if it holds none."""

    @abstractmethod
    def attach(self, req: Request, table: TableHandle) -> None: ...

    @abstractmethod
    def release_table(self, table: TableHandle) -> None: ...

    @abstractmethod
    def fork_table(self, table: TableHandle) -> TableHandle | None:
        """An independent second holder of the same KV (shared pages, copy on write); None if short of pages."""

    @abstractmethod
    def truncate_table(self, table: TableHandle, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots (uncompacted state only)."""

    def plan_decode_writes(self, batch: Any) -> None:
        """Plan a pure-decode step's writes from ``batch``'s device tensors, where ``slot_mapping`` would plan
        them on the host: for a step built on the device (``next_decode_step``) and inside a decode graph (its
        static buffers). Nothing by default."""

    def release_tail(self, table: TableHandle) -> None:
        """Give back the pages a table holds past its last slot (taken ahead for steps a request did not
        keep); none by default."""

    def can_truncate(self, table: TableHandle, num_slots: int) -> bool:
        """Whether ``truncate_table(table, num_slots)`` keeps a table that can run on (else it is recomputed)."""
        return not table.is_compacted

    def linear_state(self, reqs: list[Request], layer: int, query_lens: list[int]) -> Any:
        """The recurrent state of linear-attention layer ``layer`` for a step's requests
        (``engine.storage.recurrent.LinearState``); only caches of hybrid models have one."""
        raise NotImplementedError(f"{type(self).__name__} holds no recurrent state")

    def state_slots(self, reqs: list[Request]) -> Any:
        """The requests' recurrent-state slots, in order, as a device tensor (what a decode graph's static
        buffer holds for them); only caches of hybrid models have them."""
        raise NotImplementedError(f"{type(self).__name__} holds no recurrent state")

    def truncate_logical(self, table: TableHandle, logical_len: int, lo: int, hi: int) -> int:
        """Cut a table holding ``logical_len`` logical tokens back to the shortest length in ``[lo, hi]`` its
        state can be cut to, and return that length; 0 (table unchanged) if none. The default cuts
        uncompacted tables anywhere (``truncate_table``) and compacted ones nowhere."""
        if table.is_compacted:
            return logical_len if lo <= logical_len <= hi else 0
        if lo < logical_len:
            self.truncate_table(table, lo)
        return min(lo, logical_len)

    @abstractmethod
    def physical_len(self, req: Request, layer: int = 0) -> int: ...

    # --- what eviction and selection methods call -----------------------------------------------
    @abstractmethod
    def table(self, req: Request) -> TableHandle:
        """The request's page table: its pages (``pages``, ``pages_tensor()``) and per-layer lengths."""

    @abstractmethod
    def positions_of(self, req: Request, layer: int) -> torch.Tensor:
        """[num_kv_heads, physical_len(req, layer)] int64: the logical position each slot of each KV head holds."""

    @abstractmethod
    def table_positions(self, table: TableHandle, layer: int) -> torch.Tensor:
        """``positions_of`` for a table (a chain's, held outside any request)."""

    @abstractmethod
    def table_keys(self, table: TableHandle, layer: int) -> torch.Tensor:
        """[layer_len(layer), num_kv_heads, head_dim]: the (post-RoPE) keys a table holds in ``layer``."""

    @abstractmethod
    def compact(self, req: Request, keep: list[torch.Tensor]) -> bool:
        """Keep, per layer, the slots ``keep[layer]`` ([num_kv_heads, n_layer] int64 slot indices, each row in
        increasing order) at the front of the request's pages and free the pages no longer needed; from then
        on each layer has its own length and each slot its own logical position (``positions_of``). False
        (nothing changed) if a shared page cannot be replaced for lack of free pages."""

    @abstractmethod
    def compact_table(self, table: TableHandle, keep: list[torch.Tensor], logical_len: int) -> bool:
        """``compact`` on a table; ``logical_len`` is the logical length its slots cover."""

    # --- runner side ----------------------------------------------------------------------------
    @abstractmethod
    def slot_mapping(self, reqs: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        """[T] int64 physical slots (page * page_size + offset) where the step's new tokens are written."""

    @abstractmethod
    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        """[B, max_pages] int32 on the device: each request's pages in order (padding entries are never read)."""

    @abstractmethod
    def build_view(self, reqs: list[Request], num_new_tokens: list[int]) -> PagedView:
        """The full resident view of this step's requests, new tokens included (shared by all layers)."""

    def build_layer_views(self, reqs: list[Request], num_new_tokens: list[int]) -> list[PagedView] | None:
        """Per-layer views when layers differ in physical length; None when ``build_view`` serves every layer.
        The views differ in lengths only: every layer's ``block_tables`` names the same pages (decode CUDA
        graphs share one page table across layers)."""
        return None

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Store the step's new k/v [T, Hkv, D] at ``slot_mapping``; ``positions`` [T]: their logical positions
        (for storage that needs them)."""

    def write_rotated(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slot_mapping: torch.Tensor, positions: torch.Tensor, rotary,
                      qk_norm: tuple | None = None) -> torch.Tensor:
        """Apply ``rotary(positions, q, k)`` (RoPE, positions [T]) and ``write`` the rotated k with v; returns the
        rotated q. ``qk_norm``: optional (q_norm, k_norm) per-head RMSNorm modules (``weight`` [D], ``eps``)
        applied to q and k before RoPE. A cache manager may fuse the norms and the rotation with its store."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(positions, q, k)
        self.write(layer, k, v, slot_mapping, positions)
        return q

    @abstractmethod
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_pages, page_size, num_kv_heads, head_dim] (or, for a
        storage that encodes tokens, readers of that shape that decode on indexing: ``x.flatten(0, 1)[slots]``)."""

    def all_layer_keys(self) -> tuple[torch.Tensor, int] | None:
        """Every layer's keys as one paged tensor and the page stride between layers (``KVStorage.all_layer_keys``);
        None where the storage does not hold them so."""
        return None

    def row_target(self, layer: int) -> torch.Tensor | None:
        """The layer's rows for a kernel to store a step's key rows into at ``slot_mapping`` in the launch that
        makes them (``KVStorage.row_target``); None: ``write`` them."""
        return None

    @abstractmethod
    def write_prefix(self, req: Request, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, Hkv, D] as the request's first n slots outside a step (a restore, a synthetic fill),
        before ``commit(req, n)``."""
