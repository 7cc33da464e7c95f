"""The storage side of the lifecycle contract: how a cache's KV is represented in memory.

A cache manager owns pages and page tables (which request holds which page, prefix reuse, compaction); a
``KVStorage`` owns the bytes behind the pages and how a token is stored in them. Both address KV by physical
slot: ``page * page_size + offset``, one page id naming the same slot range in every layer. The manager
hands the storage slots, tables and lengths; the storage knows nothing of requests.

Built-in storages (``engine.storage``): ``DenseKV`` (k and v in the model dtype), ``CodedStorage`` (a codec's
fields per token group, plus a full-precision window per running request), ``LatentKV`` (one latent row per token
whose values are a slice of it), ``CodedLatentKV`` (that row coded once by a codec) and ``HybridKV`` (dense pages
for full-attention layers plus a recurrent-state slot per running request). A storage is chosen by the type of
its ``CacheSpec`` (``engine.storage.register_storage``), and the spec's ``bytes_per_page`` sizes the pool, so a new
representation is a spec subclass, a storage class and one registration: no page logic changes
(docs/architecture.md, "KV storage representations").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from engine.contract.cache import CacheSpec
    from engine.contract.codec import KVCodec
    from engine.contract.view import PagedView


class TableHandle(Protocol):
    """What a storage and a method may read of a page table (``engine.page_table.PageTable``)."""

    pages: list[int]
    num_slots: int  # slots in use in the longest layer
    window: int | None  # the storage's per-table working state (a codec's window, a recurrent state slot), if any
    state: object | None  # what the storage keeps with a stopped table (a recurrent layer's state), if anything

    @property
    def is_compacted(self) -> bool: ...

    def layer_len(self, layer: int) -> int: ...

    def ordered_from(self, layer: int) -> tuple[int, int]: ...

    def is_uniform(self) -> bool: ...

    def pages_tensor(self) -> torch.Tensor: ...


class KVStorage(ABC):
    """KV of ``spec`` for ``num_pages`` pages (the pool's pages plus a scratch page)."""

    # the storage's tensors differ per layer beyond their lengths, so a step needs one view per layer
    per_layer_views: ClassVar[bool] = False
    # a compacted table can drop the tokens appended after its compaction (they sit in order after its kept
    # slots); a storage that encodes groups spanning those tokens cannot
    cuts_appended_tokens: ClassVar[bool] = True
    # a table can be cut back to fewer slots (truncated); False where the storage keeps state that exists only at
    # the table's end (a recurrent layer's state): a cut table is recomputed instead
    cuts_tables: ClassVar[bool] = True
    codec: KVCodec | None = None  # the codec tokens are stored by, if any

    def __init__(self, spec: CacheSpec, num_pages: int):
        self.spec, self.num_pages = spec, num_pages

    # --- per-table working state ----------------------------------------------------------------
    def open_table(self, table: TableHandle) -> bool:
        """Before a table grows: acquire what a running request needs beyond its pages; False if none is
        free."""
        return True

    def close_table(self, table: TableHandle) -> None:
        """The table stops running (finished, detached, truncated): release that state; pages stay valid."""

    def drop_table_state(self, table: TableHandle) -> None:
        """The table's pages go back to the pool: drop whatever the storage keeps for it."""
        self.close_table(table)

    def fork_table_state(self, src: TableHandle, dst: TableHandle) -> None:
        """``dst`` is a fork of ``src`` (shared pages): copy what the storage keeps per table, if anything."""

    # --- a step's writes ------------------------------------------------------------------------
    def plan_step(self, tables: list[TableHandle], num_new_tokens: list[int]) -> None:
        """Called with each step's slot mapping (host side), before any ``write`` of the step."""

    def plan_decode(self, views: list[PagedView]) -> None:
        """``plan_step`` of a pure-decode step from its views' device tensors (lengths after the step), for a
        step built on the device and inside a decode graph."""

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        """Store a step's new k/v [T, Hkv, D] at physical ``slots`` [T] (``positions``: their logical positions)."""

    def write_rotated(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, rotary, qk_norm: tuple | None = None) -> torch.Tensor:
        """Optional per-head norms (``qk_norm``: q_norm, k_norm), RoPE on q and k, then ``write``; returns the
        rotated q. A storage may fuse the three."""
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(positions, q, k)
        self.write(layer, k, v, slots, positions)
        return q

    def row_target(self, layer: int) -> torch.Tensor | None:
        """Where a kernel that makes a step's key rows may store them itself, in the launch that makes them: the
        layer's rows as [slots, width] (last dim contiguous) for a storage whose ``write`` would store each token's
        key row there as it is (values a view of it: one KV head, cast to the storage's dtype); None where rows
        must go through ``write`` (dense pairs, coded rows; the CPU, whose path is the reference)."""
        return None

    @abstractmethod
    def write_prefix(self, table: TableHandle, layer: int, k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Store k/v [n, Hkv, D] as a table's first n slots (``slots``), outside a step (a restore, a fill)."""

    # --- prefix reuse -----------------------------------------------------------------------------
    @property
    def aligned_prefill(self) -> bool:
        """Whether a prefill chunk that does not end its prompt should end on a page boundary: a storage whose
        per-table state exists only at a table's end checkpoints it there for prefix reuse (``checkpoint``)."""
        return False

    def checkpoint(self, table: TableHandle, key: Any) -> None:
        """A prefill chunk of ``table`` ended on a page boundary; ``key`` is the prefix-cache key of the page
        that ends there. A storage with per-table state keeps a copy of that state for ``resumable_prefix``."""

    def resumable_prefix(self, keys: list[Any]) -> tuple[int, Any]:
        """Of a prefix match's pages (their keys, in order), how many a new table may start from, and the
        per-table state it starts with (None: none needed)."""
        return len(keys), None

    # --- moves ----------------------------------------------------------------------------------
    @abstractmethod
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages, every layer (copy on write, forks of tables whose layers differ in length)."""

    @abstractmethod
    def gather_kept(self, layer: int, table: TableHandle, old_slots: torch.Tensor, keep: torch.Tensor) -> Any:
        """Before a compaction: read what slot indices ``keep`` [Hkv, n] of ``layer`` hold (physical slots
        ``old_slots[keep]``), head by head."""

    @abstractmethod
    def scatter_kept(self, layer: int, table: TableHandle, kept: Any, new_slots: torch.Tensor) -> None:
        """After a compaction: ``kept`` (from ``gather_kept``) becomes slot indices 0..n-1 at ``new_slots``
        (``compacted_slots(n)`` of them)."""

    def gather_kept_layers(self, table: TableHandle, old_slots: torch.Tensor, keep: list[torch.Tensor]) -> Any:
        """``gather_kept`` of every layer (``keep[layer]``), what ``scatter_kept_layers`` takes: a storage may
        move all layers at once."""
        return [self.gather_kept(layer, table, old_slots, k) for layer, k in enumerate(keep)]

    def scatter_kept_layers(self, table: TableHandle, kept: Any, new_slots: torch.Tensor) -> None:
        """``scatter_kept`` of every layer, from what ``gather_kept_layers`` returned."""
        for layer, k in enumerate(kept):
            self.scatter_kept(layer, table, k, new_slots)

    def compacted_slots(self, n: int) -> int:
        """How many physical slots ``scatter_kept`` of n kept tokens writes (a codec rounds up to its group)."""
        return n

    def page_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor that holds per-page bytes, with the dimension that indexes pages: a table's pages across
        them are all a table's KV (a chain moved to host memory or disk copies exactly these)."""
        raise NotImplementedError(f"{type(self).__name__} does not list its page tensors")

    # --- reads ----------------------------------------------------------------------------------
    @abstractmethod
    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        """(keys, values) of one layer, each indexable as ``x.flatten(0, 1)[slots]`` -> [n, Hkv, D] (post-RoPE
        keys): tensors [num_pages, page_size, Hkv, D], or readers that decode on indexing."""

    def all_layer_keys(self) -> tuple[torch.Tensor, int] | None:
        """Every layer's keys as one paged tensor [X, page_size, Hkv, D] in which layer l's page p is page
        ``l * stride + p``, and that stride: a kernel that reads one layer's paged keys then reads several layers'
        in one launch, each layer a row of its block table. None where the keys are not stored so (coded)."""
        return None

    def view(self, common: dict[str, Any], tables: list[TableHandle], num_new_tokens: list[int],
             layer: int) -> PagedView:
        """The attention view of ``layer`` over ``tables`` from the page-table fields in ``common``."""
        from engine.contract.view import PagedView

        return PagedView(**common)

    def layer_view(self, view: PagedView, layer: int) -> PagedView:
        """The view of ``layer`` when its tables and lengths equal ``view``'s (``per_layer_views`` storages)."""
        return view
