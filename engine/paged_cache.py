"""The default cache manager: page tables over one page pool, with prefix reuse, copy on write and compaction.

Each request holds a ``PageTable`` (``engine.page_table``); the KV behind the pages is a ``KVStorage``
(``engine.storage``: dense, or coded by a codec), chosen by the spec's type unless one is given; a step's
slot mapping, block tables and views come from ``StepMetadata``; published full pages are matched by
``PrefixCache``. This class keeps the tables' lifecycle: allocation and growth, copy on write of a shared
tail page, tables that outlive their request (Chain Cache: detach / attach / fork / truncate), and
compaction, which gathers the slots an eviction method keeps (per layer and KV head) to the front of the
table's pages and returns the pages no longer needed. Compacted pages are never published, and a page
another table shares is replaced rather than overwritten.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.storage import KVStorage
from engine.contract.view import PagedView
from engine.page_pool import PagePool
from engine.page_table import PageTable, cdiv, kept_positions_of, physical_slots
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.step_metadata import StepMetadata
from engine.storage import make_storage

__all__ = ["PageTable", "PagedCacheManager"]


class PagedCacheManager(CacheManager):
    def __init__(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool = True,
                 storage: KVStorage | None = None):
        self.spec = spec
        self.pool = pool
        self.page_size = spec.page_size
        self.scratch_page = pool.num_pages  # never handed out: CUDA-graph padding rows write and read here
        self.storage = storage if storage is not None else make_storage(spec, pool.num_pages + 1)
        self.prefix = PrefixCache(pool, spec.page_size, self.storage) if enable_prefix_caching else None
        self.meta = StepMetadata(spec, self.storage)
        self._tables: dict[str, PageTable] = {}

    @property
    def codec(self):
        """The codec the storage encodes tokens with (None: dense)."""
        return self.storage.codec

    @property
    def prefix_index(self):
        return None if self.prefix is None else self.prefix.index

    def table(self, req: Request) -> PageTable:
        t = self._tables.get(req.request_id)
        if t is None:
            t = self._tables[req.request_id] = PageTable()
        return t

    def _slots(self, pages: list[int], start: int, n: int) -> torch.Tensor:
        return physical_slots(pages, start, n, self.page_size, self.spec.device)

    # --- scheduler side -------------------------------------------------------------------------
    @property
    def prefill_alignment(self) -> int:
        return self.page_size if self.prefix is not None and self.storage.aligned_prefill else 1

    def match_prefix(self, req: Request) -> int:
        t = self.table(req)
        assert not t.pages, "match_prefix on a request that already holds pages"
        if self.prefix is None:
            return 0
        self.prefix.match(req, t)
        t.num_slots = len(t.pages) * self.page_size
        return t.num_slots

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        t = self.table(req)
        grow = max(0, cdiv(t.num_slots + num_new_tokens, self.page_size) - len(t.pages))
        return grow + (1 if num_new_tokens and self._tail_is_shared(t) else 0)

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        need = self.pages_needed(req, num_new_tokens)
        if not self.pool.can_allocate(need):
            return False
        t = self.table(req)
        if num_new_tokens and not self.storage.open_table(t):
            return False
        if num_new_tokens:
            self._make_tail_private(t)
        grow = cdiv(t.num_slots + num_new_tokens, self.page_size) - len(t.pages)
        if grow > 0:
            new = self.pool.allocate(grow)
            t.pages.extend(new)
            if t.host_row is not None:  # extend the cached row (a long request's row is thousands of pages)
                t.host_row = np.concatenate([t.host_row, np.asarray(new, dtype=np.int32)])
        return True

    def _tail_page(self, t: PageTable) -> int | None:
        """The partly filled page new tokens would be written into, if any."""
        if t.num_slots % self.page_size == 0:
            return None
        return t.pages[t.num_slots // self.page_size]

    def _tail_is_shared(self, t: PageTable) -> bool:
        page = self._tail_page(t)
        return page is not None and self.pool.ref_counts[page] > 1

    def _make_tail_private(self, t: PageTable) -> None:
        """Before appending into a partly filled page: copy it if another holder shares it (a fork), and
        unpublish it if it is a full prefix page whose tail we would overwrite (after a rewind)."""
        page = self._tail_page(t)
        if page is None:
            return
        if self.pool.ref_counts[page] > 1:
            (copy,) = self.pool.allocate(1)
            self.storage.copy_pages([page], [copy])
            self.pool.decref(page)
            t.pages[t.num_slots // self.page_size] = copy
            t.host_row = None
        elif self.prefix is not None:
            self.prefix.forget(page)

    def free(self, req: Request) -> None:
        t = self._tables.pop(req.request_id, None)
        if t is not None:
            self.release_table(t)

    def commit(self, req: Request, num_new_tokens: int) -> None:
        t = self.table(req)
        t.num_slots += num_new_tokens
        if t.layer_lens is not None:
            t.layer_lens = [n + num_new_tokens for n in t.layer_lens]
        if self.prefix is not None and not t.is_compacted:
            self.prefix.publish(req, t)
            # a prefill chunk that ended on a page boundary: the storage may keep its state for prefix reuse
            if t.keys and len(t.keys) * self.page_size == t.num_slots \
                    and req.num_computed_tokens <= req.num_prompt_tokens:
                self.storage.checkpoint(t, t.keys[-1])

    def num_pages_held(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return len(t.pages) if t else 0

    def physical_len(self, req: Request, layer: int = 0) -> int:
        t = self._tables.get(req.request_id)
        return t.layer_len(layer) if t else 0

    def clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()

    # --- tables outliving a request (Chain Cache) -----------------------------------------------
    def holds(self, req: Request) -> bool:
        return req.request_id in self._tables

    def detach(self, req: Request) -> PageTable | None:
        """Take the request's table out of the manager without freeing it (a chain keeps it)."""
        t = self._tables.pop(req.request_id, None)
        if t is not None:
            self.storage.close_table(t)
        return t

    def attach(self, req: Request, t: PageTable) -> None:
        assert req.request_id not in self._tables
        self._tables[req.request_id] = t

    def release_table(self, t: PageTable) -> None:
        self.storage.drop_table_state(t)
        for page in reversed(t.pages):  # tail pages become the first to be reused
            self.pool.decref(page)
        t.pages, t.keys, t.host_row, t.num_slots = [], [], None, 0

    def fork_table(self, t: PageTable) -> PageTable | None:
        """A second holder of the same KV: pages are shared (refcounts), appends copy the shared tail page.

        Layers of different lengths append into different pages, so such a table is copied instead
        (None if the pool lacks the pages)."""
        if t.is_uniform():
            pages = list(t.pages)
            for page in pages:
                self.pool.incref(page)
        elif self.pool.can_allocate(len(t.pages)):
            pages = self.pool.allocate(len(t.pages))
            self.storage.copy_pages(t.pages, pages)
        else:
            return None
        fork = PageTable(pages=pages, keys=list(t.keys), num_slots=t.num_slots,
                         layer_lens=None if t.layer_lens is None else list(t.layer_lens),
                         kept_positions=t.kept_positions, compacted_at=t.compacted_at)
        self.storage.fork_table_state(t, fork)
        return fork

    def truncate_table(self, t: PageTable, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots of an uncompacted table; pages past them go back to the pool."""
        assert self.can_truncate(t, num_slots) and num_slots <= t.num_slots
        self.storage.close_table(t)
        self._drop_pages_from(t, cdiv(num_slots, self.page_size))
        t.keys = t.keys[: num_slots // self.page_size]
        t.num_slots = num_slots

    def release_tail(self, t: PageTable) -> None:
        keep = cdiv(t.num_slots, self.page_size)
        if len(t.pages) > keep:
            self._drop_pages_from(t, keep)

    def _drop_pages_from(self, t: PageTable, keep: int) -> None:
        for page in reversed(t.pages[keep:]):
            self.pool.decref(page)
        t.pages, t.host_row = t.pages[:keep], None

    def can_truncate(self, t: PageTable, num_slots: int) -> bool:
        return not t.is_compacted and (self.storage.cuts_tables or num_slots == t.num_slots)

    def linear_state(self, reqs: list[Request], layer: int, query_lens: list[int]):
        return self.storage.linear_state(self._tables_of(reqs), layer, query_lens)

    def state_slots(self, reqs: list[Request]) -> torch.Tensor:
        return self.storage.state_slots(self._tables_of(reqs))

    def truncate_logical(self, t: PageTable, logical_len: int, lo: int, hi: int) -> int:
        """See ``CacheManager.truncate_logical``. A compacted table can lose only the tokens appended after its
        last compaction (every layer holds those in order, after its kept slots), if its storage can cut them;
        a table whose storage cannot be cut resumes only whole."""
        if not self.storage.cuts_tables:
            return logical_len if lo <= logical_len <= hi else 0
        if not t.is_compacted:
            return super().truncate_logical(t, logical_len, lo, hi)
        new_len = max(lo, t.compacted_at) if self.storage.cuts_appended_tokens else logical_len
        if new_len > hi:
            return 0
        drop = logical_len - new_len
        if drop <= 0:
            return logical_len
        assert all(n - drop >= k.shape[1] for n, k in zip(t.layer_lens, t.kept_positions))
        self.storage.close_table(t)
        t.layer_lens = [n - drop for n in t.layer_lens]
        t.num_slots = max(t.layer_lens)
        self._drop_pages_from(t, cdiv(t.num_slots, self.page_size))
        return new_len

    # --- what eviction methods call -------------------------------------------------------------
    def positions_of(self, req: Request, layer: int) -> torch.Tensor:
        return self.table_positions(self._tables[req.request_id], layer)

    def table_positions(self, t: PageTable, layer: int) -> torch.Tensor:
        return t.positions(layer, self.spec.num_kv_heads, self.spec.device)

    def table_keys(self, t: PageTable, layer: int) -> torch.Tensor:
        """[physical_len(layer), num_kv_heads, head_dim]: the (post-RoPE) keys a table holds in ``layer``
        (decoded from their codes under a codec)."""
        return self.layer_kv(layer)[0].flatten(0, 1)[self._slots(t.pages, 0, t.layer_len(layer))]

    def compact(self, req: Request, keep: list[torch.Tensor]) -> bool:
        return self.compact_table(self._tables[req.request_id], keep, req.num_computed_tokens)

    def compact_table(self, t: PageTable, keep: list[torch.Tensor], logical_len: int) -> bool:
        assert len(keep) == self.spec.num_layers
        new_lens = [k.shape[1] for k in keep]
        need = cdiv(max(new_lens), self.page_size)
        assert need <= len(t.pages)
        tail, head = t.pages[need:], t.pages[:need]
        shared = sum(1 for p in head if self.pool.ref_counts[p] > 1)
        if shared > self.pool.num_free + sum(1 for p in tail if self.pool.ref_counts[p] == 1):
            return False
        old_slots = self._slots(t.pages, 0, t.num_slots)
        positions = kept_positions_of(t, keep, self.spec.num_kv_heads, self.spec.device)
        kept = self.storage.gather_kept_layers(t, old_slots, keep)
        for page in reversed(tail):
            self.pool.decref(page)
        for i, page in enumerate(head):
            if self.pool.ref_counts[page] > 1:
                head[i] = self.pool.allocate(1)[0]
                self.pool.decref(page)
            elif self.prefix is not None:
                self.prefix.forget(page)
        new_slots = self._slots(head, 0, self.storage.compacted_slots(max(new_lens)))
        self.storage.scatter_kept_layers(t, kept, new_slots)
        t.pages, t.keys, t.host_row = head, [], None
        t.layer_lens, t.num_slots = new_lens, max(new_lens)
        t.kept_positions, t.compacted_at = positions, logical_len
        return True

    # --- runner side ----------------------------------------------------------------------------
    def _tables_of(self, reqs: list[Request]) -> list[PageTable]:
        return [self._tables[r.request_id] for r in reqs]

    def slot_mapping(self, reqs: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        return self.meta.slot_mapping(self._tables_of(reqs), num_new_tokens)

    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        return self.meta.block_tables(self._tables_of(reqs))

    def build_view(self, reqs: list[Request], num_new_tokens: list[int], layer: int = 0) -> PagedView:
        return self.meta.build_view(self._tables_of(reqs), num_new_tokens, layer)

    def build_layer_views(self, reqs: list[Request], num_new_tokens: list[int]) -> list[PagedView] | None:
        return self.meta.build_layer_views(self._tables_of(reqs), num_new_tokens)

    def plan_decode_writes(self, batch) -> None:
        self.storage.plan_decode(batch.layer_views or [batch.view])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        if slot_mapping.dim() == 2:
            slot_mapping = slot_mapping[layer]
        self.storage.write(layer, k, v, slot_mapping, positions)

    def write_rotated(self, layer, q, k, v, slot_mapping, positions, rotary, qk_norm=None):
        if slot_mapping.dim() == 2:
            slot_mapping = slot_mapping[layer]
        return self.storage.write_rotated(layer, q, k, v, slot_mapping, positions, rotary, qk_norm=qk_norm)

    def layer_kv(self, layer: int):
        return self.storage.layer_kv(layer)

    def all_layer_keys(self):
        return self.storage.all_layer_keys()

    def row_target(self, layer: int):
        return self.storage.row_target(layer)

    def write_prefix(self, req: Request, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, Hkv, D] as the request's first n slots outside a step (a restore, a synthetic
        fill), before ``commit(req, n)``; the request holds no slots yet."""
        t = self.table(req)
        assert t.layer_len(layer) == 0 and not t.is_compacted
        self.storage.write_prefix(t, layer, k, v, self._slots(t.pages, 0, k.shape[0]))
