"""The default cache manager: paged KV with prefix reuse and compaction.

Storage is one tensor ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``; a page id names the
same slot range in every layer. Each request holds a page table; slot ``s`` of a request lives in page
``pages[s // page_size]`` at offset ``s % page_size``.

Until an eviction method compacts a request, slot ``s`` holds logical position ``s`` in every layer and head.
``compact`` gathers the slots a method keeps (per layer and KV head) to the front of the request's pages and
returns the pages it no longer needs to the pool; from then on each layer has its own physical length and
each (layer, head) slot its own logical position (``positions_of``). Compacted pages are never published to
the prefix index, and a page another request shares is replaced rather than overwritten.

With a codec (``CodedCacheSpec``) the storage is ``engine.kv_storage.CodedStorage`` instead of ``kv``:
tokens are encoded on ``write``, compaction moves their fields (re-encoding groups that span tokens), and a
running request's recent slots also sit in a full-precision window (acquired on ``allocate``, released when
the request stops holding the table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.view import PagedView, QuantizedPagesView
from engine.kv_memory import zeroed
from engine.kv_storage import CodedStorage, DecodedPages, WritePlan
from engine.page_pool import PagePool
from engine.prefix_index import PageKey, PrefixIndex, page_key
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PageTable:
    pages: list[int] = field(default_factory=list)
    keys: list[PageKey] = field(default_factory=list)  # keys of the leading full, published pages
    num_slots: int = 0  # slots in use in the longest layer
    layer_lens: list[int] | None = None  # per-layer slots in use, once compacted
    kept_positions: list[torch.Tensor] | None = None  # per layer [Hkv, n]: logical position of each kept slot
    host_row: np.ndarray | None = None  # int32 copy of ``pages`` for building block tables; None = stale
    compacted_at: int = 0  # logical length at the last compaction; later slots are appended tokens
    window: int | None = None  # full-precision window (codecs with one), held while a request runs

    @property
    def is_compacted(self) -> bool:
        return self.layer_lens is not None

    def is_uniform(self) -> bool:
        return self.layer_lens is None or min(self.layer_lens) == max(self.layer_lens)

    def layer_len(self, layer: int) -> int:
        return self.num_slots if self.layer_lens is None else self.layer_lens[layer]

    def pages_row(self) -> np.ndarray:
        if self.host_row is None:
            self.host_row = np.asarray(self.pages, dtype=np.int32)
        return self.host_row

    def pages_tensor(self) -> torch.Tensor:
        """The cached row as an int32 host tensor (shares its memory; treat it as read-only)."""
        return torch.from_numpy(self.pages_row())


def fuse_rotary_store(kv: torch.Tensor) -> bool:
    """Whether ``write_rotated`` runs the fused Triton RoPE + store kernel on this KV tensor: on a GPU."""
    return kv.is_cuda


@dataclass
class DeferredWritePlans:
    """A step's host write plans for a codec with a window, not yet built: per layer (one entry when every
    request's layers have one length) the (window, old length, new rows, row offset) of each request, and
    their page lists."""

    coded: CodedStorage
    items: list[list[tuple[int, int, int, int]]]
    pages: list[list[int]]
    num_layers: int

    def build(self) -> list[WritePlan]:
        plans = [self.coded.plan(items, self.pages) for items in self.items]
        return plans * self.num_layers if len(plans) == 1 else plans


class PagedCacheManager(CacheManager):
    def __init__(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool = True):
        self.spec = spec
        self.pool = pool
        self.page_size = spec.page_size
        self.prefix_index = PrefixIndex() if enable_prefix_caching else None
        if self.prefix_index is not None:
            pool.on_reuse = self.prefix_index.forget
        self.scratch_page = pool.num_pages  # never handed out: CUDA-graph padding rows write and read here
        self.codec = getattr(spec, "codec", None)
        self.coded: CodedStorage | None = None
        if self.codec is not None:
            self.coded = CodedStorage(spec, pool.num_pages + 1)
            self.kv = None
        else:
            self.kv = zeroed(
                (spec.num_layers, 2, pool.num_pages + 1, spec.page_size, spec.num_kv_heads, spec.head_dim),
                spec.dtype, spec.device)
        self._tables: dict[str, PageTable] = {}
        self._write_plans: list[WritePlan] | DeferredWritePlans | None = None
        self._prefix_plan: tuple | None = None  # write_prefix's plan, shared by the layers of one request

    def table(self, req: Request) -> PageTable:
        t = self._tables.get(req.request_id)
        if t is None:
            t = self._tables[req.request_id] = PageTable()
        return t

    # --- scheduler side -------------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        t = self.table(req)
        assert not t.pages, "match_prefix on a request that already holds pages"
        if self.prefix_index is None:
            return 0
        ps = self.page_size
        tokens = req.token_ids
        parent: PageKey | None = req.prefix_namespace
        usable = len(tokens) - 1  # always leave >= 1 token to compute for logits
        if req.max_prefix_reuse is not None:
            usable = min(usable, req.max_prefix_reuse)
        for i in range(usable // ps):
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_key(parent, chunk)
            page = self.prefix_index.lookup(key, parent, chunk)
            if page is None:
                break
            self.pool.incref(page)
            t.pages.append(page)
            t.keys.append(key)
            parent = key
        t.num_slots = len(t.pages) * ps
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
        if num_new_tokens and not self._ensure_window(t):
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

    def _ensure_window(self, t: PageTable) -> bool:
        """A codec with a window: give ``t`` one, loaded from codes; False if every window is taken."""
        if self.codec is None or not self.codec.has_window or t.window is not None:
            return True
        t.window = self.coded.acquire_window()
        if t.window is None:
            return False
        layer_slots = []
        for layer in range(self.spec.num_layers):
            n = t.layer_len(layer)
            start = self.codec.quant_len(n)
            layer_slots.append((start, self._slots(t.pages, start, n - start)))
        self.coded.fill_window(t.window, layer_slots)
        return True

    def _drop_window(self, t: PageTable) -> None:
        if t.window is not None:
            self.coded.release_window(t.window)
            t.window = None

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        if self.coded is not None:
            self.coded.copy_pages(src, dst)
        else:
            self.kv[:, :, dst] = self.kv[:, :, src]

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
            self._copy_pages([page], [copy])
            self.pool.decref(page)
            t.pages[t.num_slots // self.page_size] = copy
            t.host_row = None
        elif self.prefix_index is not None:
            self.prefix_index.forget(page)

    def free(self, req: Request) -> None:
        t = self._tables.pop(req.request_id, None)
        if t is not None:
            self.release_table(t)

    # --- tables outliving a request (Chain Cache) -----------------------------------------------
    def holds(self, req: Request) -> bool:
        return req.request_id in self._tables

    def detach(self, req: Request) -> PageTable | None:
        """Take the request's table out of the manager without freeing it (a chain keeps it)."""
        t = self._tables.pop(req.request_id, None)
        if t is not None:
            self._drop_window(t)  # codes stay valid; the window reloads from them on the next allocate
        return t

    def attach(self, req: Request, t: PageTable) -> None:
        assert req.request_id not in self._tables
        self._tables[req.request_id] = t

    def release_table(self, t: PageTable) -> None:
        self._drop_window(t)
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
            self._copy_pages(t.pages, pages)
        else:
            return None
        return PageTable(pages=pages, keys=list(t.keys), num_slots=t.num_slots,
                         layer_lens=None if t.layer_lens is None else list(t.layer_lens),
                         kept_positions=t.kept_positions, compacted_at=t.compacted_at)

    def truncate_table(self, t: PageTable, num_slots: int) -> None:
        """Keep the first ``num_slots`` slots of an uncompacted table; pages past them go back to the pool."""
        assert not t.is_compacted and num_slots <= t.num_slots
        self._drop_window(t)
        keep = cdiv(num_slots, self.page_size)
        for page in reversed(t.pages[keep:]):
            self.pool.decref(page)
        t.pages = t.pages[:keep]
        t.keys = t.keys[: num_slots // self.page_size]
        t.num_slots, t.host_row = num_slots, None

    def release_tail(self, t: PageTable) -> None:
        keep = cdiv(t.num_slots, self.page_size)
        if len(t.pages) > keep:
            for page in reversed(t.pages[keep:]):
                self.pool.decref(page)
            t.pages, t.host_row = t.pages[:keep], None

    def truncate_logical(self, t: PageTable, logical_len: int, lo: int, hi: int) -> int:
        """See ``CacheManager.truncate_logical``. A compacted table can lose only the tokens appended after its
        last compaction (every layer holds those in order, after its kept slots); under a codec, none."""
        if not t.is_compacted:
            return super().truncate_logical(t, logical_len, lo, hi)
        new_len = max(lo, t.compacted_at) if self.coded is None else logical_len
        if new_len > hi:
            return 0
        drop = logical_len - new_len
        if drop <= 0:
            return logical_len
        assert all(n - drop >= k.shape[1] for n, k in zip(t.layer_lens, t.kept_positions))
        self._drop_window(t)
        t.layer_lens = [n - drop for n in t.layer_lens]
        t.num_slots = max(t.layer_lens)
        keep = cdiv(t.num_slots, self.page_size)
        for page in reversed(t.pages[keep:]):
            self.pool.decref(page)
        t.pages, t.host_row = t.pages[:keep], None
        return new_len

    def commit(self, req: Request, num_new_tokens: int) -> None:
        t = self.table(req)
        t.num_slots += num_new_tokens
        if t.layer_lens is not None:
            t.layer_lens = [n + num_new_tokens for n in t.layer_lens]
        if self.prefix_index is None or t.is_compacted:
            return
        ps = self.page_size
        num_full = t.num_slots // ps
        tokens = req.token_ids
        while len(t.keys) < num_full:
            i = len(t.keys)
            parent = t.keys[-1] if t.keys else req.prefix_namespace
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_key(parent, chunk)
            self.prefix_index.insert(key, parent, chunk, t.pages[i])
            t.keys.append(key)

    def num_pages_held(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return len(t.pages) if t else 0

    def physical_len(self, req: Request, layer: int = 0) -> int:
        t = self._tables.get(req.request_id)
        return t.layer_len(layer) if t else 0

    def positions_of(self, req: Request, layer: int) -> torch.Tensor:
        """[num_kv_heads, physical_len] int64: the logical position held by each slot of each KV head."""
        return self.table_positions(self._tables[req.request_id], layer)

    def table_positions(self, t: PageTable, layer: int) -> torch.Tensor:
        device, heads = self.spec.device, self.spec.num_kv_heads
        if t.kept_positions is None:
            return torch.arange(t.num_slots, device=device).expand(heads, -1)
        kept = t.kept_positions[layer]
        appended = torch.arange(t.compacted_at, t.compacted_at + t.layer_len(layer) - kept.shape[1], device=device)
        return torch.cat([kept, appended.expand(heads, -1)], dim=1)

    def table_keys(self, t: PageTable, layer: int) -> torch.Tensor:
        """[physical_len(layer), num_kv_heads, head_dim]: the (post-RoPE) keys a table holds in ``layer``
        (decoded from their codes under a codec)."""
        return self.layer_kv(layer)[0].flatten(0, 1)[self._slots(t.pages, 0, t.layer_len(layer))]

    def compact(self, req: Request, keep: list[torch.Tensor]) -> bool:
        """Keep, per layer, the slots ``keep[layer]`` ([num_kv_heads, n_layer] int64 slot indices, each row in
        increasing order); free the pages no longer needed. False (nothing changed) if a shared page cannot be
        replaced for lack of free pages."""
        return self.compact_table(self._tables[req.request_id], keep, req.num_computed_tokens)

    def compact_table(self, t: PageTable, keep: list[torch.Tensor], logical_len: int) -> bool:
        """``compact`` on a table; ``logical_len`` is the logical length its slots cover."""
        assert len(keep) == self.spec.num_layers
        ps, heads = self.page_size, self.spec.num_kv_heads
        new_lens = [k.shape[1] for k in keep]
        need = cdiv(max(new_lens), ps)
        assert need <= len(t.pages)
        tail, head = t.pages[need:], t.pages[:need]
        shared = sum(1 for p in head if self.pool.ref_counts[p] > 1)
        if shared > self.pool.num_free + sum(1 for p in tail if self.pool.ref_counts[p] == 1):
            return False
        old_slots = self._slots(t.pages, 0, t.num_slots)
        head_idx = torch.arange(heads, device=self.spec.device)[None, :]
        positions = [self.table_positions(t, layer).gather(1, k) for layer, k in enumerate(keep)]
        if self.coded is not None:
            kept = [self.coded.gather_kept(layer, old_slots, k, self._quant_len(t, layer), t.window)
                    for layer, k in enumerate(keep)]
        else:
            kept = [(self.kv[layer, 0].flatten(0, 1)[old_slots[k.T], head_idx],
                     self.kv[layer, 1].flatten(0, 1)[old_slots[k.T], head_idx]) for layer, k in enumerate(keep)]
        for page in reversed(tail):
            self.pool.decref(page)
        for i, page in enumerate(head):
            if self.pool.ref_counts[page] > 1:
                head[i] = self.pool.allocate(1)[0]
                self.pool.decref(page)
            elif self.prefix_index is not None:
                self.prefix_index.forget(page)
        new_slots = self._slots(head, 0, max(new_lens))
        if self.coded is not None:
            new_slots = self._slots(head, 0, cdiv(max(new_lens), self.codec.group) * self.codec.group)
            for layer, k in enumerate(kept):
                self.coded.scatter_kept(layer, k, new_slots, t.window)
            kept = []
        for layer, (k, v) in enumerate(kept):
            n = k.shape[0]
            self.kv[layer, 0].flatten(0, 1)[new_slots[:n]] = k
            self.kv[layer, 1].flatten(0, 1)[new_slots[:n]] = v
        t.pages, t.keys, t.host_row = head, [], None
        t.layer_lens, t.num_slots = new_lens, max(new_lens)
        t.kept_positions, t.compacted_at = positions, logical_len
        return True

    def clear_prefix_cache(self) -> None:
        if self.prefix_index is not None:
            self.prefix_index.clear()

    # --- runner side ----------------------------------------------------------------------------
    def _slot_list(self, pages: list[int], start: int, n: int, out: list[int]) -> None:
        ps = self.page_size
        pos, end = start, start + n
        while pos < end:
            page, off = divmod(pos, ps)
            take = min(ps - off, end - pos)
            base = pages[page] * ps + off
            out.extend(range(base, base + take))
            pos += take

    def _slots(self, pages: list[int], start: int, n: int) -> torch.Tensor:
        """Physical slots of slot indices ``start .. start + n - 1`` over ``pages`` ([n] int64 on the cache's
        device), built in numpy: a 128K-slot fill or restore calls this once per layer."""
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64, device=self.spec.device)
        ps = self.page_size
        first = start // ps
        rows = np.asarray(pages[first:(start + n - 1) // ps + 1], dtype=np.int64)
        slots = (rows[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()[start - first * ps:][:n]
        return torch.from_numpy(slots).to(self.spec.device)

    def _layer_lens(self, tables: list[PageTable]) -> np.ndarray:
        """[num_layers, B] C-contiguous int64 array of each request's slots in use per layer (numpy: a nested list
        converts ~4x faster than through torch.tensor at a few hundred requests x 32 layers). Contiguous, so
        that a layer's row of the lengths built from it is a contiguous tensor: the kernels index it by
        request (a transposed array kept its strides through ``+`` and ``astype``, and every layer's lengths
        were read with a stride of num_layers)."""
        num_layers = self.spec.num_layers
        rows = [[t.num_slots] * num_layers if t.layer_lens is None else t.layer_lens for t in tables]
        return np.ascontiguousarray(np.array(rows, dtype=np.int64).reshape(len(tables), num_layers).T)

    def _host_block_tables(self, tables: list[PageTable]) -> torch.Tensor:
        """[B, max_pages] int32 host page table (padding entries page 0), filled row by row from each table's
        cached numpy row (3-8x faster than ``pad_sequence`` over torch rows at a few hundred requests)."""
        width = max((len(t.pages) for t in tables), default=0)
        out = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            out[i, :len(t.pages)] = t.pages_row()
        return torch.from_numpy(out)

    def slot_mapping(self, reqs: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        """[T] when every request has one length across layers, else [num_layers, T]. Under a codec with a
        window this also plans the step's writes (which groups are re-encoded, which rows enter windows)."""
        tables = [self._tables[r.request_id] for r in reqs]
        if self.codec is not None and self.codec.has_window:
            self._write_plans = self._plan_writes(tables, num_new_tokens)
        uniform = all(t.is_uniform() for t in tables)
        if tables and all(n == 1 for n in num_new_tokens):  # a decode step: one slot per request and layer
            return self._decode_slots(tables, uniform).to(self.spec.device)
        if uniform:
            slots: list[int] = []
            for t, n in zip(tables, num_new_tokens):
                self._slot_list(t.pages, t.layer_len(0), n, slots)
            return torch.tensor(slots, dtype=torch.int64, device=self.spec.device)
        rows = []
        for layer in range(self.spec.num_layers):
            slots = []
            for t, n in zip(tables, num_new_tokens):
                self._slot_list(t.pages, t.layer_len(layer), n, slots)
            rows.append(slots)
        return torch.tensor(rows, dtype=torch.int64, device=self.spec.device)

    def _decode_slots(self, tables: list[PageTable], uniform: bool) -> torch.Tensor:
        """The next slot of every request ([B], or [num_layers, B] when its layers differ in length): one
        comprehension over the requests, or numpy over the padded page table and the per-layer lengths --
        not a page walk per request and layer."""
        ps = self.page_size
        if uniform:
            return torch.tensor([t.pages[n // ps] * ps + n % ps for t in tables for n in (t.layer_len(0),)],
                                dtype=torch.int64)
        lens = self._layer_lens(tables)  # [L, B]
        pages = self._host_block_tables(tables).numpy().astype(np.int64)  # [B, P]
        slots = np.take_along_axis(pages, (lens // ps).T, axis=1).T * ps + lens % ps
        return torch.from_numpy(np.ascontiguousarray(slots))

    def _plan_writes(self, tables: list[PageTable], num_new_tokens: list[int]) -> DeferredWritePlans:
        """The step's write plans, built on the first write that needs them: a replayed decode graph writes
        from its own device plan (``plan_decode_writes``) and never does. Lengths, windows and page lists are
        taken now, as the step was prepared."""
        rows = [0]
        for n in num_new_tokens:
            rows.append(rows[-1] + n)
        pages = [t.pages for t in tables]
        layers = [0] if all(t.is_uniform() for t in tables) else range(self.spec.num_layers)
        items = [[(t.window, t.layer_len(layer), n, r) for t, n, r in zip(tables, num_new_tokens, rows)]
                 for layer in layers]
        return DeferredWritePlans(self.coded, items, pages, self.spec.num_layers)

    def _quant_len(self, t: PageTable, layer: int, extra: int = 0) -> int:
        """Slots attention reads from codes (the rest from the window)."""
        n = t.layer_len(layer) + extra
        return self.codec.quant_len(n) if t.window is not None else n

    def block_tables(self, reqs: list[Request]) -> torch.Tensor:
        """Copied from pinned memory without waiting: a plain host-to-GPU copy waits for all the work queued
        on the stream, and an overlapped decode window is launched while the previous one runs."""
        host = self._host_block_tables([self._tables[r.request_id] for r in reqs])
        if self.spec.device.type != "cuda":
            return host
        return host.pin_memory().to(self.spec.device, non_blocking=True)

    def build_view(self, reqs: list[Request], num_new_tokens: list[int], layer: int = 0) -> PagedView:
        tables = [self._tables[r.request_id] for r in reqs]
        kv_lens = [t.layer_len(layer) + n for t, n in zip(tables, num_new_tokens)]
        block_tables = self._host_block_tables(tables)  # padding entries are page 0, never read
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        device = self.spec.device
        common = dict(
            block_tables=block_tables.to(device),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            page_size=self.page_size,
            kv_lens_cpu=kv_lens,
            query_lens_cpu=list(num_new_tokens),
        )
        if self.codec is None:
            return PagedView(**common)
        quant = [self._quant_len(t, layer, n) for t, n in zip(tables, num_new_tokens)]
        windows = None
        if self.codec.has_window:
            windows = [self.coded.scratch_window if t.window is None else t.window for t in tables]
        common.update(codec=self.codec, quant_lens=torch.tensor(quant, dtype=torch.int32, device=device),
                      quant_lens_cpu=quant, window_ids_cpu=windows,
                      window_ids=None if windows is None else torch.tensor(windows, dtype=torch.int32, device=device))
        return self._coded_view(common, layer)

    def _coded_view(self, common: dict, layer: int) -> QuantizedPagesView:
        k_fields, v_fields, window_k, window_v = self.coded.per_layer_fields[layer]
        return QuantizedPagesView(**common, layer=layer, k_fields=k_fields, v_fields=v_fields, window_k=window_k,
                                  window_v=window_v)

    def build_layer_views(self, reqs: list[Request], num_new_tokens: list[int]) -> list[PagedView] | None:
        """One view per layer when some request's layers differ in length or the storage is per layer (a
        codec); None when ``build_view`` serves all."""
        uniform = all(self._tables[r.request_id].is_uniform() for r in reqs)
        if self.codec is None and uniform:
            return None
        if uniform:  # one set of tables and lengths; only the layer's storage differs
            base = self.build_view(reqs, num_new_tokens)
            common = {f.name: getattr(base, f.name) for f in fields(QuantizedPagesView)
                      if f.name not in ("k_fields", "v_fields", "window_k", "window_v", "layer")}
            return [base] + [self._coded_view(common, layer) for layer in range(1, self.spec.num_layers)]
        if self.codec is None:  # lengths differ per layer: one page table, one host->device copy of the lengths
            base = self.build_view(reqs, num_new_tokens)
            tables = [self._tables[r.request_id] for r in reqs]
            lens_np = self._layer_lens(tables) + np.asarray(num_new_tokens, dtype=np.int64)
            lens = lens_np.tolist()
            lens_t = torch.from_numpy(lens_np.astype(np.int32)).to(self.spec.device)
            return [dataclasses.replace(base, kv_lens=lens_t[layer], kv_lens_cpu=lens[layer])
                    for layer in range(self.spec.num_layers)]
        return [self.build_view(reqs, num_new_tokens, layer) for layer in range(self.spec.num_layers)]

    def plan_decode_writes(self, batch) -> None:
        """Under a codec with a window: the new rows into the rings and the open groups re-encoded, planned
        from the views' lengths (after the step), window ids and page tables on the device."""
        if self.codec is not None and self.codec.has_window:
            views = batch.layer_views or [batch.view]
            self._write_plans = self.coded.plan_decode(torch.stack([v.kv_lens for v in views]), views[0].window_ids,
                                                       views[0].block_tables, self.page_size)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              positions: torch.Tensor | None = None) -> None:
        if slot_mapping.dim() == 2:
            slot_mapping = slot_mapping[layer]
        if self.coded is not None:
            if isinstance(self._write_plans, DeferredWritePlans):
                self._write_plans = self._write_plans.build()
            plans = self._write_plans
            self.coded.write(layer, k, v, slot_mapping, None if plans is None else plans[layer], positions)
            return
        kv = self.kv[layer]
        if kv.is_cuda:
            from agentrt_kernels.triton import store_kv

            store_kv(k, v, kv[0], kv[1], slot_mapping)
            return
        flat_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        kv[0].view(flat_shape).index_copy_(0, slot_mapping, k.to(kv.dtype))
        kv[1].view(flat_shape).index_copy_(0, slot_mapping, v.to(kv.dtype))

    def write_rotated(self, layer, q, k, v, slot_mapping, positions, rotary, qk_norm=None):
        """Dense KV on a GPU: one Triton kernel (q/k norms first, with ``qk_norm``) rotates q in place and stores
        rotated k and v (k itself is not written back); otherwise, or under a subclass's own ``write``, the
        norms, RoPE, then ``write``."""
        kv = self.kv[layer] if self.coded is None else None
        if kv is None or not fuse_rotary_store(kv) or type(self).write is not PagedCacheManager.write:
            return super().write_rotated(layer, q, k, v, slot_mapping, positions, rotary, qk_norm=qk_norm)
        from agentrt_kernels.triton import rotary_and_store

        if slot_mapping.dim() == 2:
            slot_mapping = slot_mapping[layer]
        norm = {}
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            assert q_norm.eps == k_norm.eps, (q_norm.eps, k_norm.eps)
            norm = dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps)
        return rotary_and_store(positions, q, k, v, rotary.cos_cache, rotary.sin_cache, kv[0], kv[1], slot_mapping,
                                **norm)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Under a codec: ``DecodedPages`` readers of the same shape (decoded on indexing), not tensors."""
        if self.coded is not None:
            return DecodedPages(self.coded, layer, "k"), DecodedPages(self.coded, layer, "v")
        return self.kv[layer, 0], self.kv[layer, 1]

    def write_prefix(self, req: Request, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, Hkv, D] as the request's first n slots outside a step (a restore, a synthetic
        fill), before ``commit(req, n)``; the request holds no slots yet."""
        t = self.table(req)
        assert t.layer_len(layer) == 0 and not t.is_compacted
        n = k.shape[0]
        if self.coded is None:
            slots = self._slots(t.pages, 0, n)
            self.kv[layer, 0].flatten(0, 1)[slots] = k.to(self.kv.dtype)
            self.kv[layer, 1].flatten(0, 1)[slots] = v.to(self.kv.dtype)
            return
        plan = None
        if self.codec.has_window:
            key = (req.request_id, n, t.window)
            if self._prefix_plan is None or self._prefix_plan[0] != key:
                items = [(self.coded.scratch_window if t.window is None else t.window, 0, n, 0)]
                self._prefix_plan = key, self.coded.plan(items, [t.pages])
            plan = self._prefix_plan[1]
        self.coded.write(layer, k, v, self._slots(t.pages, 0, n), plan, torch.arange(n, device=k.device))
