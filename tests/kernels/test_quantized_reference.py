"""The blocked reference over coded pages (``quantized_paged_attention``) is plain attention: with an identity
"codec" (pages decoded by a gather of full-precision KV) it equals the dense reference ``paged_attention`` on
the same pages for any block size (GQA, causal prefill rows, decode rows, a full-precision window ring),
and its probabilities equal the dense ones."""

import pytest
import torch

from agentrt_kernels.torch_ref.paged_attention import paged_attention
from agentrt_kernels.torch_ref.quantized_attention import _pages_per_block, quantized_paged_attention


def _case(seed: int, page_size: int = 4, hkv: int = 2, group: int = 4, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    query_lens, kv_lens = [3, 1, 5], [23, 9, 37]
    pages_per = max(-(-n // page_size) for n in kv_lens)
    num_pages = len(kv_lens) * pages_per + 1
    k = torch.randn(num_pages, page_size, hkv, d, generator=g)
    v = torch.randn(num_pages, page_size, hkv, d, generator=g)
    tables = (torch.randperm(num_pages - 1, generator=g)[: len(kv_lens) * pages_per] + 1).view(len(kv_lens), -1)
    q = torch.randn(sum(query_lens), hkv * group, d, generator=g)
    return q, k, v, tables, kv_lens, query_lens


@pytest.mark.parametrize("blocking", [{"pages_per_block": 1}, {"pages_per_block": 3}, {},
                                      {"block_bytes": 1}, {"block_bytes": 2**30}])
def test_blocked_reference_equals_dense_attention(blocking):
    q, k, v, tables, kv_lens, query_lens = _case(0)
    scale = q.shape[-1] ** -0.5
    want, want_p = paged_attention(q, k, v, tables, kv_lens, query_lens, scale, return_scores=True)
    got, got_p = quantized_paged_attention(
        q, lambda p: k[p].flatten(0, 1), lambda p: v[p].flatten(0, 1), tables, k.shape[1], kv_lens, kv_lens,
        query_lens, scale, return_scores=True, **blocking)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_p, want_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_window_slots_come_from_the_ring():
    """Slots at and after quant_len are read from the request's ring row at slot % capacity."""
    q, k, v, tables, kv_lens, query_lens = _case(1)
    page_size, cap = k.shape[1], 8
    quant = [n - 5 for n in kv_lens]  # the last five slots of each request live in its window
    ring_k = torch.randn(len(kv_lens) + 1, cap, *k.shape[2:])
    ring_v = torch.randn(len(kv_lens) + 1, cap, *k.shape[2:])
    wids = [2, 0, 3]
    full_k, full_v = k.clone(), v.clone()  # the dense view: the ring's rows written into the pages
    for i, (n, qn) in enumerate(zip(kv_lens, quant)):
        for s in range(qn, n):
            page, off = tables[i, s // page_size], s % page_size
            full_k[page, off], full_v[page, off] = ring_k[wids[i], s % cap], ring_v[wids[i], s % cap]
    scale = q.shape[-1] ** -0.5
    want, _ = paged_attention(q, full_k, full_v, tables, kv_lens, query_lens, scale)
    got, _ = quantized_paged_attention(
        q, lambda p: k[p].flatten(0, 1), lambda p: v[p].flatten(0, 1), tables, page_size, kv_lens, quant,
        query_lens, scale, window_k=ring_k, window_v=ring_v, window_ids=wids, pages_per_block=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_size_follows_the_byte_budget():
    # per slot: fp32 K and V for 32 heads x 128 plus logits and probabilities for 32 heads x 64 rows
    per_slot = 4 * (2 * 32 * 128 + 2 * 32 * 64)
    assert _pages_per_block(512 * 2**20, 32, 32, 64, 128) == 512 * 2**20 // (per_slot * 32)
    assert _pages_per_block(1, 32, 32, 64, 128) == 1
