"""A decode step's slot mapping, computed from the padded page table in tensor ops, equals the per-request,
per-layer walk over each request's pages that prefill chunks use (uniform and per-layer lengths)."""

import random

import torch

from engine.contract.cache import CacheSpec
from engine.page_pool import PagePool
from engine.page_table import extend_slot_list, physical_slots
from engine.paged_cache import PageTable, PagedCacheManager


def walk(cache, tables, layer):
    out = []
    for t in tables:
        extend_slot_list(t.pages, t.layer_len(layer), 1, cache.page_size, out)
    return out


def test_decode_slots_equal_the_page_walk():
    rng = random.Random(0)
    spec = CacheSpec(num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                     page_size=4)
    cache = PagedCacheManager(spec, PagePool(200), enable_prefix_caching=False)
    perm = list(range(200))
    rng.shuffle(perm)
    tables = []
    for i in range(9):
        n = rng.randrange(0, 37)  # slots in use; the next one may open a new page
        pages = [perm.pop() for _ in range(n // 4 + 1)]
        t = PageTable(pages=pages, num_slots=n)
        if i % 3 == 1:  # compacted: each layer its own length, none past the longest
            t.layer_lens = [rng.randrange(0, n + 1) for _ in range(5)]
            t.layer_lens[rng.randrange(5)] = n
        tables.append(t)
    uniform = cache.meta._decode_slots([t for t in tables if t.is_uniform()], True)
    assert uniform.tolist() == walk(cache, [t for t in tables if t.is_uniform()], 0)
    per_layer = cache.meta._decode_slots(tables, False)
    assert per_layer.shape == (5, 9)
    assert per_layer.tolist() == [walk(cache, tables, layer) for layer in range(5)]


def test_slot_ranges_equal_the_page_walk():
    """``physical_slots`` (numpy, one call per layer of a fill or restore) equals the page walk for any range."""
    rng = random.Random(1)
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
                     page_size=4)
    cache = PagedCacheManager(spec, PagePool(64), enable_prefix_caching=False)
    for _ in range(200):
        pages = [rng.randrange(64) for _ in range(rng.randrange(1, 9))]
        start = rng.randrange(len(pages) * 4)
        n = rng.randrange(len(pages) * 4 - start + 1)
        out = []
        extend_slot_list(pages, start, n, 4, out)
        got = physical_slots(pages, start, n, 4, torch.device("cpu"))
        assert got.dtype == torch.int64 and got.tolist() == out, (pages, start, n)
