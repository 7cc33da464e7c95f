"""Prefix index: full pages keyed by a hash chain over token ids.

``key(i) = blake2b(key(i-1) || tokens of page i)``, so a key names a page *and* everything before it. Every
hit is verified against the stored token ids and the parent key, so a collision can never serve wrong KV.
The index does not own pages: it only remembers which page holds which prefix. Refcounts live in the pool;
when the pool reuses a free page, ``forget`` drops it.
"""

from array import array
from collections.abc import Sequence
from hashlib import blake2b

PageKey = bytes


def page_key(parent: PageKey | None, tokens: Sequence[int]) -> PageKey:
    h = blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixIndex:
    def __init__(self) -> None:
        self._page_by_key: dict[PageKey, int] = {}
        self._entry_by_page: dict[int, tuple[PageKey, PageKey | None, tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._page_by_key)

    def lookup(self, key: PageKey, parent: PageKey | None, tokens: Sequence[int]) -> int | None:
        page = self._page_by_key.get(key)
        if page is None:
            return None
        _, stored_parent, stored_tokens = self._entry_by_page[page]
        if stored_parent != parent or stored_tokens != tuple(tokens):
            return None
        return page

    def insert(self, key: PageKey, parent: PageKey | None, tokens: Sequence[int], page: int) -> bool:
        """Publish ``page`` as holding ``tokens`` after ``parent``; False if that prefix is already held."""
        if key in self._page_by_key or page in self._entry_by_page:
            return False
        self._page_by_key[key] = page
        self._entry_by_page[page] = (key, parent, tuple(tokens))
        return True

    def forget(self, page: int) -> None:
        entry = self._entry_by_page.pop(page, None)
        if entry is not None:
            del self._page_by_key[entry[0]]

    def holds(self, page: int) -> bool:
        return page in self._entry_by_page

    def clear(self) -> None:
        self._page_by_key.clear()
        self._entry_by_page.clear()
