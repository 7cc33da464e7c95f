"""Prefix caching over the page tables: a new request takes the published full pages of its longest cached
prefix (``match``); a request's full pages are published as it computes them (``publish``). Compacted tables
publish nothing (their pages no longer hold the tokens in order). A storage with per-table state (a hybrid
model's recurrent layers) decides how much of a match a table can start from, and with what state
(``KVStorage.resumable_prefix``)."""

from __future__ import annotations

from engine.contract.storage import KVStorage
from engine.page_pool import PagePool
from engine.page_table import PageTable
from engine.prefix_index import PageKey, PrefixIndex, page_key
from engine.request import Request


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int, storage: KVStorage | None = None):
        self.index = PrefixIndex()
        self.pool, self.page_size, self.storage = pool, page_size, storage
        pool.on_reuse = self.index.forget  # a reused free page no longer holds its prefix

    def match(self, req: Request, t: PageTable) -> None:
        """Attach (and hold) the pages of the request's longest published prefix to its empty table."""
        ps = self.page_size
        tokens = req.token_ids
        parent: PageKey | None = req.prefix_namespace
        usable = len(tokens) - 1  # always leave >= 1 token to compute for logits
        if req.max_prefix_reuse is not None:
            usable = min(usable, req.max_prefix_reuse)
        for i in range(usable // ps):
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_key(parent, chunk)
            page = self.index.lookup(key, parent, chunk)
            if page is None:
                break
            self.pool.incref(page)
            t.pages.append(page)
            t.keys.append(key)
            parent = key
        if self.storage is not None and t.keys:
            n, state = self.storage.resumable_prefix(t.keys)
            for page in t.pages[n:]:
                self.pool.decref(page)
            del t.pages[n:], t.keys[n:]
            if state is not None:
                t.state = state

    def publish(self, req: Request, t: PageTable) -> None:
        """Publish the table's full pages not yet published."""
        ps = self.page_size
        num_full = t.num_slots // ps
        tokens = req.token_ids
        while len(t.keys) < num_full:
            i = len(t.keys)
            parent = t.keys[-1] if t.keys else req.prefix_namespace
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_key(parent, chunk)
            self.index.insert(key, parent, chunk, t.pages[i])
            t.keys.append(key)

    def forget(self, page: int) -> None:
        """The page's content is about to change: it no longer holds the prefix it was published for."""
        self.index.forget(page)

    def clear(self) -> None:
        self.index.clear()
