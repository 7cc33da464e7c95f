"""The default cache manager: dense paged KV with prefix reuse.

Storage is one tensor ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``; a page id names the
same slot range in every layer. Each request holds a page table; slot ``s`` of a request lives in page
``pages[s // page_size]`` at offset ``s % page_size``. Physical length equals logical length here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.view import PagedView
from engine.page_pool import PagePool
from engine.prefix_index import PageKey, PrefixIndex, page_key
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PageTable:
    pages: list[int] = field(default_factory=list)
    keys: list[PageKey] = field(default_factory=list)  # keys of the leading full, published pages
    num_slots: int = 0  # slots written (== the request's computed tokens for the dense manager)


class PagedCacheManager(CacheManager):
    def __init__(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool = True):
        self.spec = spec
        self.pool = pool
        self.page_size = spec.page_size
        self.prefix_index = PrefixIndex() if enable_prefix_caching else None
        if self.prefix_index is not None:
            pool.on_reuse = self.prefix_index.forget
        self.kv = torch.zeros(
            (spec.num_layers, 2, pool.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=spec.device,
        )
        self._tables: dict[str, PageTable] = {}

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
        parent: PageKey | None = None
        for i in range((len(tokens) - 1) // ps):  # always leave >= 1 token to compute for logits
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
        return max(0, cdiv(t.num_slots + num_new_tokens, self.page_size) - len(t.pages))

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        need = self.pages_needed(req, num_new_tokens)
        if not self.pool.can_allocate(need):
            return False
        if need:
            self.table(req).pages.extend(self.pool.allocate(need))
        return True

    def free(self, req: Request) -> None:
        t = self._tables.pop(req.request_id, None)
        if t is None:
            return
        for page in reversed(t.pages):  # tail pages become the first to be reused
            self.pool.decref(page)

    def commit(self, req: Request) -> None:
        t = self.table(req)
        t.num_slots = req.num_computed_tokens
        if self.prefix_index is None:
            return
        ps = self.page_size
        num_full = t.num_slots // ps
        tokens = req.token_ids
        while len(t.keys) < num_full:
            i = len(t.keys)
            parent = t.keys[-1] if t.keys else None
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_key(parent, chunk)
            self.prefix_index.insert(key, parent, chunk, t.pages[i])
            t.keys.append(key)

    def num_pages_held(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return len(t.pages) if t else 0

    def physical_len(self, req: Request, layer: int = 0) -> int:
        t = self._tables.get(req.request_id)
        return t.num_slots if t else 0

    def clear_prefix_cache(self) -> None:
        if self.prefix_index is not None:
            self.prefix_index.clear()

    # --- runner side ----------------------------------------------------------------------------
    def slot_mapping(self, reqs: list[Request], num_new_tokens: list[int]) -> torch.Tensor:
        ps = self.page_size
        slots: list[int] = []
        for req, n in zip(reqs, num_new_tokens):
            t = self._tables[req.request_id]
            pos, end = t.num_slots, t.num_slots + n
            while pos < end:
                page, off = divmod(pos, ps)
                take = min(ps - off, end - pos)
                base = t.pages[page] * ps + off
                slots.extend(range(base, base + take))
                pos += take
        return torch.tensor(slots, dtype=torch.int64, device=self.spec.device)

    def build_view(self, reqs: list[Request], num_new_tokens: list[int]) -> PagedView:
        tables = [self._tables[r.request_id] for r in reqs]
        kv_lens = [t.num_slots + n for t, n in zip(tables, num_new_tokens)]
        width = max((len(t.pages) for t in tables), default=0)
        rows = [t.pages + [0] * (width - len(t.pages)) for t in tables]
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        device = self.spec.device
        return PagedView(
            block_tables=torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), width),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            page_size=self.page_size,
            kv_lens_cpu=kv_lens,
            query_lens_cpu=list(num_new_tokens),
        )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv = self.kv[layer]
        flat_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        kv[0].view(flat_shape).index_copy_(0, slot_mapping, k.to(kv.dtype))
        kv[1].view(flat_shape).index_copy_(0, slot_mapping, v.to(kv.dtype))

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0], self.kv[layer, 1]
