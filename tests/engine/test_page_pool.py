"""Property tests for the page pool and the prefix index against a plain-Python model of their state."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.page_pool import PagePool
from engine.prefix_index import PrefixIndex, page_key

ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 7)), min_size=1, max_size=80
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_pool_matches_refcount_model(operations):
    pool = PagePool(8)
    refs = {p: 0 for p in range(8)}
    for op, arg in operations:
        if op == "alloc":
            n = arg % 4
            free = [p for p, r in refs.items() if r == 0]
            if n > len(free):
                assert not pool.can_allocate(n)
                continue
            pages = pool.allocate(n)
            assert len(set(pages)) == n
            for p in pages:
                assert refs[p] == 0
                refs[p] = 1
        elif op == "incref":
            pool.incref(arg)
            refs[arg] += 1
        elif refs[arg] > 0:
            pool.decref(arg)
            refs[arg] -= 1
        assert pool.num_free == sum(r == 0 for r in refs.values())
        assert pool.ref_counts == [refs[p] for p in range(8)]
        assert all(pool.is_free(p) == (refs[p] == 0) for p in range(8))


def test_pool_reuses_least_recently_freed_first_and_reports_reuse():
    reused = []
    pool = PagePool(4, on_reuse=reused.append)
    a = pool.allocate(4)
    for p in (a[2], a[0], a[3]):
        pool.decref(p)
    assert pool.allocate(2) == [a[2], a[0]]
    assert reused[-2:] == [a[2], a[0]]


page_tokens = st.lists(st.integers(0, 3), min_size=2, max_size=2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(page_tokens, min_size=1, max_size=4), min_size=1, max_size=6))
def test_prefix_index_finds_exactly_the_inserted_chains(chains):
    index = PrefixIndex()
    held: dict[tuple, int] = {}  # full prefix (tuple of page tuples) -> page
    next_page = 0
    for chain in chains:
        parent = None
        for i, tokens in enumerate(chain):
            key = page_key(parent, tokens)
            prefix = tuple(map(tuple, chain[: i + 1]))
            if prefix not in held:
                assert index.insert(key, parent, tokens, next_page)
                held[prefix] = next_page
                next_page += 1
            parent = key
    for prefix, page in held.items():
        parent = None
        for tokens in prefix[:-1]:
            parent = page_key(parent, tokens)
        assert index.lookup(page_key(parent, prefix[-1]), parent, prefix[-1]) == page
    assert len(index) == len(held)


def test_prefix_index_verifies_tokens_and_parent():
    index = PrefixIndex()
    key = page_key(None, [1, 2])
    index.insert(key, None, [1, 2], 5)
    assert index.lookup(key, None, [1, 2]) == 5
    assert index.lookup(key, None, [1, 3]) is None  # forged key: tokens differ
    assert index.lookup(key, b"x" * 16, [1, 2]) is None  # parent differs
    index.forget(5)
    assert index.lookup(key, None, [1, 2]) is None and len(index) == 0
