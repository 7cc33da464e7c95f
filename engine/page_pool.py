"""The one page pool every cache manager draws from.

Pages are ids into the KV storage. A page with refcount 0 sits in the free list; the free list is ordered
least-recently-freed first, so a freed page that still holds a reusable prefix lives as long as possible
before ``allocate`` hands it out again (``on_reuse`` tells the prefix index to forget it then).
"""

from collections import OrderedDict
from collections.abc import Callable


class PagePool:
    def __init__(self, num_pages: int, on_reuse: Callable[[int], None] | None = None):
        assert num_pages > 0
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.on_reuse = on_reuse

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), f"allocate({n}) with {len(self._free)} free pages"
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self.ref_counts[page] = 1
            if self.on_reuse is not None:
                self.on_reuse(page)
            pages.append(page)
        return pages

    def incref(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self._free[page]
        self.ref_counts[page] += 1

    def decref(self, page: int) -> None:
        assert self.ref_counts[page] > 0, f"page {page} freed twice"
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self._free[page] = None

    def is_free(self, page: int) -> bool:
        return page in self._free
