"""The MLA paged decode kernel (``agentrt_kernels.triton.mla_decode``) against a dense torch computation: each
request's latent rows gathered through its page table, softmax(q k^T * scale) in fp32, times the rows' first Dv
channels. Runs compiled on a GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1) at tiny sizes."""

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.triton.mla_decode import mla_num_splits, mla_paged_decode  # noqa: E402
from tests.kernels.sm90_compile import compiled_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) for attention outputs of O(1) magnitude, as tests/kernels/test_triton_kernels.py's ATTN_TOL
ATTN_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2e-2)}


def _case(seed, dtype, batch_lens, hq, dk, page_size, extra_pages=3, pad_pages=0):
    """q [B, Hq, Dk], latent [P, page_size, 1, Dk], block tables over shuffled pages (rows padded with other
    valid page ids, which the kernel must not read past kv_len), kv_lens int32."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(max(n, 1) / page_size) for n in batch_lens]
    num_pages = sum(need) + extra_pages
    latent = torch.randn(num_pages, page_size, 1, dk, generator=g).to(dtype)
    q = torch.randn(len(batch_lens), hq, dk, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    max_pages = max(need) + pad_pages
    bt = perm[torch.randint(0, num_pages, (len(batch_lens), max_pages), generator=g)]  # garbage padding
    start = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[start:start + n]
        start += n
    kv_lens = torch.tensor(batch_lens, dtype=torch.int32)
    return q.to(DEVICE), latent.to(DEVICE), bt.to(torch.int32).to(DEVICE), kv_lens.to(DEVICE)


def _dense(q, latent, bt, kv_lens, scale, dv):
    """[B, Hq, Dv] fp32: request b's rows gathered through bt, attended in fp32; a 0-length request gives 0."""
    rows_all = latent.reshape(latent.shape[0], latent.shape[1], -1).float()
    page_size = rows_all.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float32, device=q.device)
    for b, n in enumerate(kv_lens.tolist()):
        if n == 0:
            continue
        rows = rows_all[bt[b, : math.ceil(n / page_size)].long()].flatten(0, 1)[:n]  # [n, Dk]
        probs = torch.softmax(q[b].float() @ rows.T * scale, dim=-1)
        out[b] = probs @ rows[:, :dv]
    return out


def _close(got, want, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


CASES = [
    # dtype, hq, dk, dv, page_size, num_splits, block_n: every dtype x page size x head count x split mode at a
    # small latent (Dk 48 = 32 value channels + 16 rope channels) ...
    (dtype, hq, 48, 32, page_size, num_splits, block_n)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for page_size, block_n in ((16, 16), (64, None))
    for hq in (16, 20)
    for num_splits in (1, 3)
] + [
    # ... widths that are not powers of two (value part padded 40 -> 64, rope part 12 -> 16), no rope part,
    # many heads (several head tiles), and the real DeepSeek-V3 / GLM-4.7-Flash latent (512 + 64)
    (torch.float16, 20, 52, 40, 16, 2, 16),
    (torch.bfloat16, 16, 40, 24, 64, 1, 32),
    (torch.float32, 16, 32, 32, 16, 2, 16),
    (torch.float16, 72, 48, 32, 16, 3, 16),
    (torch.bfloat16, 20, 576, 512, 64, 2, None),
    (torch.float16, 16, 576, 512, 16, 1, None),
    (torch.float32, 20, 576, 512, 16, 3, 16),
]


@pytest.mark.parametrize("dtype,hq,dk,dv,page_size,num_splits,block_n", CASES)
def test_mla_decode_matches_dense(dtype, hq, dk, dv, page_size, num_splits, block_n):
    kv_lens = [1, 37, 150]  # 1, non-multiples of the page size, several pages, tiles and splits
    q, latent, bt, lens = _case(zlib.crc32(f"{dtype}-{hq}-{dk}-{dv}-{page_size}".encode()), dtype, kv_lens, hq, dk,
                                page_size, pad_pages=1)
    scale = 192 ** -0.5  # DeepSeek's (qk_nope 128 + rope 64) ** -0.5
    out = torch.full((len(kv_lens), hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_paged_decode(q, latent, bt, lens, scale, dv, num_splits=num_splits, out=out, block_n=block_n)
    assert got is out and got.shape == (len(kv_lens), hq, dv) and got.dtype == dtype
    _close(got, _dense(q, latent, bt, lens, scale, dv), dtype)


@pytest.mark.parametrize("dtype,hq,dk,dv,page_size,num_splits,block_n", [
    (dtype, hq, 48, 32, page_size, num_splits, block_n)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for page_size, block_n in ((16, 16), (64, 64))
    for hq, num_splits in ((16, 1), (20, 3))
] + [(torch.float16, 20, 52, 40, 16, 2, 32), (torch.bfloat16, 20, 576, 512, 16, 2, 64),
     (torch.float32, 72, 576, 512, 64, 1, 16)])
def test_the_products_transposed_equal_dense_attention(dtype, hq, dk, dv, page_size, num_splits, block_n):
    """``keys_as_rows``: S^T = K Q^T and O^T = V^T P^T (the rows' tile as the dots' M), the softmax along the
    rows' axis: dense attention, over every dtype, page size, a partial head tile, splits, padded widths, the real
    latent (512 + 64) and several head tiles."""
    kv_lens = [1, 37, 150]
    q, latent, bt, lens = _case(zlib.crc32(f"rows-{dtype}-{hq}-{dk}-{page_size}".encode()), dtype, kv_lens, hq, dk,
                                page_size, pad_pages=1)
    scale = 192 ** -0.5
    got = mla_paged_decode(q, latent, bt, lens, scale, dv, num_splits=num_splits, block_n=block_n,
                           keys_as_rows=True)
    _close(got, _dense(q, latent, bt, lens, scale, dv), dtype)
    with pytest.raises(ValueError, match="keys_as_rows"):
        mla_paged_decode(q, latent, bt, lens, scale, dv, keys_as_rows=True,
                         row_scales=(torch.ones(1), torch.ones(1)))


@pytest.mark.parametrize("dtype,hq,dk,dv,page_size,num_splits,block_n", [
    (dtype, hq, 48, 32, page_size, num_splits, block_n)
    for dtype in (torch.float16, torch.bfloat16)
    for page_size, block_n in ((16, 16), (64, 32), (64, 64), (16, 64))
    for hq, num_splits in ((16, 1), (20, 3))
] + [(torch.float16, 20, 52, 40, 16, 2, 16), (torch.bfloat16, 16, 32, 32, 16, 2, 16),
     (torch.bfloat16, 20, 576, 512, 64, 2, 64), (torch.float16, 72, 576, 512, 16, 1, 16),
     (torch.bfloat16, 20, 576, 512, 16, 2, 64)])
def test_whole_tiles_read_by_tma_equal_dense_attention(dtype, hq, dk, dv, page_size, num_splits, block_n):
    """``tma``: full tiles read as blocks of the pool's row view (value channels in two halves), the split's
    partial last tile gathered with its masks; tiles spanning pages (64 rows over 16-row pages) gathered, in
    halves too: dense attention over every 16-bit dtype, tiles of a page, of part of one and of several, splits, a
    partial head tile, padded widths (40 + 12), no rope part, the real latent (512 + 64), several head tiles.
    The pool's unused rows hold NaN: a tile reading them would poison the output."""
    kv_lens = [1, 37, 150, 64]
    q, latent, bt, lens = _case(zlib.crc32(f"tma-{dtype}-{hq}-{dk}-{page_size}-{block_n}".encode()), dtype, kv_lens,
                                hq, dk, page_size, pad_pages=1)
    used = torch.zeros(latent.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens.tolist()):
        for i in range(n):
            used[bt[b, i // page_size].long(), i % page_size] = True
    latent[~used] = float("nan")
    scale = 192 ** -0.5
    want = _dense(q, latent, bt, lens, scale, dv)
    got = mla_paged_decode(q, latent, bt, lens, scale, dv, num_splits=num_splits, block_n=block_n, tma=True)
    _close(got, want, dtype)
    with pytest.raises(ValueError, match="tma"):
        mla_paged_decode(q, latent, bt, lens, scale, dv, tma=True, keys_as_rows=True)


def test_tma_takes_only_layouts_whose_tiles_are_blocks_of_the_pool():
    """``tma_layout``: a page size BLOCK_N does not divide, fp32 rows, pages not one stride of rows apart, rows not
    16-byte aligned or value halves wider than a TMA box fall back to the gather kernel (same outputs); padded
    rows at a constant stride are one row view."""
    from agentrt_kernels.triton.mla_decode_tma import tma_layout

    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    pool = torch.zeros(4, 64, 576, **bf)
    assert tma_layout(pool, 64, 512, 576).shape == (256, 576)
    assert tma_layout(pool, 128, 512, 576) is None  # a tile would cross pages
    assert tma_layout(pool.float(), 64, 512, 576) is None
    assert tma_layout(torch.zeros(8, 64, 576, **bf)[::2], 64, 512, 576) is None  # a page apart: not one row view
    padded = tma_layout(torch.zeros(4, 64, 2, 576, **bf)[:, :, 0], 64, 512, 576)  # rows 1152 channels apart
    assert padded.shape == (256, 576) and padded.stride() == (1152, 1)
    assert tma_layout(torch.zeros(4, 64, 20, **bf)[..., :12], 16, 8, 12) is None  # rows of 24 bytes
    assert tma_layout(torch.zeros(4, 64, 1024, **bf), 64, 1024, 1024) is None  # value halves past one box
    q, latent, bt, lens = _case(7, torch.float16, [37, 150], 16, 48, 16)
    want = _dense(q, latent, bt, lens, 0.2, 32)
    _close(mla_paged_decode(q, latent, bt, lens, 0.2, 32, block_n=32, tma=True), want, torch.float16)


@pytest.mark.parametrize("dtype,hq,dk,dv,page_size,num_splits", [
    (torch.float32, 16, 48, 32, 16, 1), (torch.float32, 20, 48, 32, 16, 3), (torch.float16, 20, 52, 40, 16, 2),
    (torch.bfloat16, 16, 576, 512, 64, 2)])
def test_e4m3_latent_rows_equal_attention_over_their_decoded_rows(dtype, hq, dk, dv, page_size, num_splits):
    """Rows stored as E4M3 codes with a latent and a rotary scale (``kv_storage="fp8"`` on an MLA model): the
    kernel reading the codes equals dense attention over the rows the codec decodes (the rotary channels made
    10x larger, so the two scales differ). A kernel that ignored either scale, or applied the latent scale to
    the rotary channels, would not."""
    from policies.fp8_kv import E4M3LatentRow

    kv_lens = [1, 37, 150]
    q, latent, bt, lens = _case(zlib.crc32(f"e4m3-{dtype}-{hq}-{dk}".encode()), torch.float32, kv_lens, hq, dk,
                                page_size, pad_pages=1)
    latent[..., dv:] *= 10.0
    row = E4M3LatentRow(dv)
    fields = row.encode(latent)
    decoded = row.decode(fields, dk)
    assert fields["codes"].dtype == torch.uint8 and not torch.equal(fields["scale"], fields["rope_scale"])
    scale = 192 ** -0.5
    q = q.to(dtype)
    got = mla_paged_decode(q, fields["codes"], bt, lens, scale, dv, num_splits=num_splits,
                           row_scales=(fields["scale"], fields["rope_scale"]))
    assert got.shape == (len(kv_lens), hq, dv) and got.dtype == dtype
    want = _dense(q, decoded.to(DEVICE), bt, lens, scale, dv)
    _close(got, want, dtype)


def test_three_dim_latent_strided_q_default_splits_and_empty_rows():
    """latent given as [P, ps, Dk]; q a strided slice of a wider buffer; num_splits left to the default; a
    kv_len 0 row (CUDA-graph padding) comes out as zeros."""
    dtype, hq, dk, dv, page_size = torch.float16, 20, 48, 32, 16
    kv_lens = [45, 0, 17]
    q_wide, latent, bt, lens = _case(7, dtype, kv_lens, hq, dk + 16, page_size)
    q = q_wide[..., :dk]
    latent = latent[..., :dk].contiguous()[:, :, 0]
    for splits in (None, 1, 5):
        got = mla_paged_decode(q, latent, bt, lens, 0.2, dv, num_splits=splits, block_n=16)
        assert torch.all(got[1] == 0)
        _close(got, _dense(q, latent, bt, lens, 0.2, dv), dtype)


def test_split_boundaries_and_mutations_matter():
    """A request spanning many pages and all 4 splits matches the dense result, and the comparison is sharp:
    a wrong scale, a context cut by one row, or a values slice shifted by one channel all miss it."""
    dtype, hq, dk, dv, page_size = torch.float32, 16, 48, 32, 16
    kv_lens = [200, 64]
    q, latent, bt, lens = _case(11, dtype, kv_lens, hq, dk, page_size)
    scale = dk ** -0.5
    got = mla_paged_decode(q, latent, bt, lens, scale, dv, num_splits=4, block_n=16)
    want = _dense(q, latent, bt, lens, scale, dv)
    _close(got, want, dtype)
    # splitting does not change the result beyond rounding
    _close(mla_paged_decode(q, latent, bt, lens, scale, dv, num_splits=1, block_n=16), want, dtype)

    def misses(other):
        return (got.float() - other).abs().max().item() > 1e-3

    assert misses(_dense(q, latent, bt, lens, scale * 1.1, dv))
    assert misses(_dense(q, latent, bt, lens - 1, scale, dv))
    shifted = _dense(q, torch.roll(latent, -1, dims=-1), bt, lens, scale, dv)  # values from channels 1..Dv
    assert misses(shifted)
    # and the kernel itself reacts to each input
    cut = mla_paged_decode(q, latent, bt, lens - 1, scale, dv, num_splits=4, block_n=16)
    _close(cut, _dense(q, latent, bt, lens - 1, scale, dv), dtype)
    assert misses(cut.float())


def test_a_grid_sized_for_long_contexts_serves_short_ones():
    """As in a decode graph captured for the longest context: many splits with a minimum split length, most of
    them empty for the short requests."""
    dtype, hq, dk, dv, page_size = torch.bfloat16, 16, 48, 32, 16
    kv_lens = [1, 40, 300]
    q, latent, bt, lens = _case(3, dtype, kv_lens, hq, dk, page_size)
    got = mla_paged_decode(q, latent, bt, lens, 0.15, dv, num_splits=16, block_n=16, min_split_tokens=64)
    _close(got, _dense(q, latent, bt, lens, 0.15, dv), dtype)


def test_mla_num_splits():
    assert mla_num_splits(1024, 1, 4096, 132) == 1  # big batches already fill the GPU
    assert mla_num_splits(1, 1, 32768, 132) == 64  # one long request: bounded by MAX_SPLITS
    assert mla_num_splits(1, 4, 300, 132) == 1  # short contexts are not split below ~256 tokens a split
    assert mla_num_splits(8, 1, 4096, 132) == 16  # 8 requests of 4096 rows: 16 splits of 256
    assert mla_num_splits(32, 1, 8192, 132) == 4  # one wave of one program a SM
    assert mla_num_splits(32, 1, 8192, 132, programs_per_sm=2) == 8  # one wave of two a SM


def test_the_launch_whose_one_wave_holds_the_most_splits():
    """GLM-4.7-Flash's 20 heads (one 32-head tile), the cases the GPU sweep measured: bs8 @ 4K keeps the 64-row
    tile (one a SM, 16 splits: a tie with two a SM, whose splits the context caps at 16 too), bs32 @ 4K and
    bs8 @ 32K take the 32-row tile on 4 warps (two a SM: 8 and 33 splits in one wave, against 4 and 16)."""
    from agentrt_kernels.triton.mla_decode import _launch_candidates, choose_launch

    candidates = _launch_candidates(32, 512, torch.bfloat16)
    assert choose_launch(candidates, 8, 1, 4096, 132) == ((64, 8, 5, 1), 16)
    assert choose_launch(candidates, 32, 1, 4096, 132) == ((32, 4, 2, 2), 8)
    assert choose_launch(candidates, 8, 1, 32768, 132) == ((32, 4, 2, 2), 33)
    # past one wave at one split: two a SM (at bs32 @ 4K it was the faster over 16 splits too, four waves of one
    # a SM against two of two)
    assert choose_launch(candidates, 1024, 1, 4096, 132) == ((32, 4, 2, 2), 1)
    # 16-head tiles have one launch; its split count still fills one wave
    assert choose_launch(_launch_candidates(16, 512, torch.bfloat16), 8, 2, 4096, 132) == ((32, 4, 2, 2), 16)
    # 64-head tiles: 32 rows in five stages (one a SM); E4M3 rows: 64 rows on 8 warps at 16 and 32 heads
    assert choose_launch(_launch_candidates(64, 512, torch.bfloat16), 8, 2, 4096, 132) == ((32, 8, 5, 1), 8)
    assert _launch_candidates(16, 512, torch.bfloat16, coded=True) == [(64, 8, 2, 1)]
    assert _launch_candidates(32, 512, torch.bfloat16, coded=True) == [(64, 8, 2, 1)]


def test_when_the_halves_kernel_is_the_default():
    """``halves_by_default``: reading by TMA, the halves launch (one program a SM) takes a call whose one wave
    holds at most HALVES_MAX_SPLITS splits a request -- GLM-4.7-Flash's 20 heads (one 32-head tile) at bs32 @ 4K
    (4 splits), not at bs8 @ 4K (16); a short context caps the splits too (bs8 @ 512: 2). Gathering (pages that
    do not hold whole tiles), its five-stage launch takes every call whose requests' head tiles fit one wave of
    one program a SM (bs132 of 20 heads on 132 SMs, not bs133; bs66 of 128 heads, not bs67), at 16, 32 and 64
    heads a tile. AGENTRT_MLA_TMA's "1" / "0" override both ways."""
    from agentrt_kernels.triton.mla_decode import HALVES_MAX_SPLITS, _launch_candidates, halves_by_default

    assert _launch_candidates(32, 512, torch.bfloat16, tma=True) == [(64, 8, 3, 1)]
    assert _launch_candidates(32, 512, torch.bfloat16, tma=True, gathered=True) == [(64, 8, 5, 1)]
    assert _launch_candidates(16, 512, torch.bfloat16, tma=True) == [(32, 4, 3, 2)]
    assert _launch_candidates(16, 512, torch.bfloat16, tma=True, gathered=True) == [(32, 4, 5, 2)]
    assert _launch_candidates(64, 512, torch.bfloat16, tma=True) == [(16, 8, 3, 1)]
    assert _launch_candidates(64, 512, torch.bfloat16, tma=True, gathered=True) == [(32, 8, 5, 1)]
    assert halves_by_default(8, 1, 4096, 132, 32, gathered=True) and halves_by_default(1, 1, 32768, 132, 32, None, True)
    assert not halves_by_default(8, 1, 4096, 132, 32, "0", gathered=True)
    assert halves_by_default(132, 1, 4096, 132, 32, gathered=True)
    assert not halves_by_default(133, 1, 4096, 132, 32, gathered=True)
    # every head tile gathering (16 heads: DeepSeek-V2-Lite; 128: DeepSeek-V3's two tiles of 64), to one wave
    assert halves_by_default(32, 1, 4096, 132, 16, gathered=True) and halves_by_default(8, 2, 4096, 132, 64, None, True)
    assert halves_by_default(66, 2, 4096, 132, 64, gathered=True)
    assert not halves_by_default(67, 2, 4096, 132, 64, gathered=True)

    assert HALVES_MAX_SPLITS == 4
    assert halves_by_default(32, 1, 4096, 132, 32) and halves_by_default(64, 1, 4096, 132, 32)
    assert not halves_by_default(8, 1, 4096, 132, 32) and not halves_by_default(16, 1, 4096, 132, 32)
    assert halves_by_default(8, 1, 512, 132, 32)  # 2 splits of at least 256 rows
    assert halves_by_default(8, 1, 4096, 132, 32, choice="1") and not halves_by_default(32, 1, 4096, 132, 32, "0")
    # reading by TMA, only the 32-head tile it was measured on: 16- and 64-head tiles keep the gather kernel
    assert not halves_by_default(64, 1, 4096, 132, 16) and not halves_by_default(32, 2, 4096, 132, 64)
    assert halves_by_default(32, 2, 4096, 132, 64, choice="1")


def test_rejects_bad_shapes():
    q, latent, bt, lens = _case(5, torch.float32, [5, 7], 16, 48, 16)
    with pytest.raises(AssertionError):
        mla_paged_decode(q, latent.expand(-1, -1, 2, -1), bt, lens, 0.1, 32)  # two KV heads
    with pytest.raises(AssertionError):
        mla_paged_decode(q, latent, bt, lens, 0.1, 64)  # value_dim > Dk
    with pytest.raises(ValueError, match="kv_lens"):
        mla_paged_decode(q, latent, bt, torch.stack([lens, lens], 1)[:, 0], 0.1, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mla_decode_cuda_graph():
    """Captured once, replayed with new q, page tables and kv lens written into the static inputs."""
    dtype, hq, dk, dv, page_size, batch, max_pages = torch.bfloat16, 20, 576, 512, 64, 3, 6
    q, latent, bt, lens = _case(21, dtype, [max_pages * page_size] * batch, hq, dk, page_size, extra_pages=8)
    out = torch.empty(batch, hq, dv, dtype=dtype, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_paged_decode(q, latent, bt, lens, 0.07, dv, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_paged_decode(q, latent, bt, lens, 0.07, dv, out=out)
    for seed, kv_lens in ((1, [1, 100, 384]), (2, [383, 3, 64])):
        q2, _, bt2, lens2 = _case(seed, dtype, [max_pages * page_size] * batch, hq, dk, page_size, extra_pages=8)
        q.copy_(q2)
        bt.copy_(bt2)
        lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        graph.replay()
        _close(out, _dense(q, latent, bt, lens, 0.07, dv), dtype)


_SM90_SCRIPT = """
import json, sys
import torch
import triton
from benchmarks.kernel_resources import compile_sm90
from agentrt_kernels.triton import mla_decode as m
rows = []
for dtype, hq, splits, coded in json.loads(sys.argv[1]):
    tdtype = getattr(torch, dtype)
    block_h = 16 if tdtype == torch.float32 else m.default_block_h(hq)
    block_h = min(block_h, 32) if coded else block_h
    for block_n, warps, stages, declared in m._launch_candidates(block_h, 512, tdtype, coded):
        ty = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
        args = dict(q_ptr=ty, kv_ptr="*u8" if coded else ty, bt_ptr="*i32", lens_ptr="*i32", out_ptr=ty,
                    mid_o_ptr="*fp32", mid_lse_ptr="*fp32", sv_ptr="*fp32", sr_ptr="*fp32", scale_log2=0.1,
                    num_heads=hq, stride_qb=hq * 576, stride_qh=576, stride_kp=64 * 576, stride_ks=576,
                    stride_sp=64 if coded else 0, stride_ss=1 if coded else 0, stride_btb=1037,
                    stride_ob=hq * 512, stride_oh=512, CODED=coded, KEYS_AS_ROWS=False,
                    BLOCK_H=block_h, DV=512, BLOCK_DV=512, DK=576, BLOCK_DR=64, HAS_REST=True, PAGE_SIZE=64,
                    BLOCK_N=block_n, NUM_SPLITS=splits, MIN_SPLIT=0, UPCAST=False,
                    PRECISION="ieee" if dtype == "float32" else "tf32",
                    PDL=True)  # as a Hopper launches it
        r = compile_sm90(m._mla_split_kernel, args, num_warps=warps, num_stages=stages, launch_pdl=True)
        rows.append(dict(dtype=dtype, hq=hq, splits=splits, coded=coded, block_h=block_h,
                         launch=[block_n, warps, stages], declared=declared, **{k: r[k] for k in (
                             "registers", "spill_stores", "shared_bytes", "programs_per_sm", "LDGSTS",
                             "launch_order")}))
print(json.dumps(rows))
"""


_SM90_ROWS_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton.mla_decode import mla_paged_decode

rows = []
for block_n, warps, stages in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    with captured_launches() as launches:
        mla_paged_decode(torch.zeros(8, 20, 576, **bf), torch.zeros(64, 16, 1, 576, **bf),
                         torch.zeros(8, 256, dtype=torch.int32), torch.full((8,), 4096, dtype=torch.int32),
                         0.07, 512, block_n=block_n, num_warps=warps, num_stages=stages, keys_as_rows=True)
    fn, args, options = launches[0]  # the split kernel (the combine follows)
    r = compile_sm90(fn, args, **options)
    rows.append(dict(launch=[args["BLOCK_N"], options["num_warps"], options["num_stages"]], **{k: r[k] for k in (
        "registers", "spill_stores", "shared_bytes", "HGMMA", "HMMA")}))
print(json.dumps(rows))
"""


def test_the_transposed_products_take_wgmma_on_sm90():
    """``keys_as_rows`` at GLM-4.7-Flash's decode shape (20 heads, latent 512 + 64, page 16), as compiled for an
    H100 / H200: the products run on wgmma (HGMMA, none on mma.sync), in one SM's shared memory (227 KB), without
    spills, for its default launch (no overrides) and those ``benchmarks.mla_decode_sweep`` tries (64 rows on 8
    warps, 2 / 3 stages; 4 warps, 3: a few bytes spilled, 48 under the Triton of an H100 image, none under ours)."""
    rows = compiled_rows(_SM90_ROWS_SCRIPT, [[None, None, None], [64, 8, 2], [64, 8, 3], [64, 4, 3]])
    assert [r["launch"] for r in rows] == [[64, 8, 3], [64, 8, 2], [64, 8, 3], [64, 4, 3]]
    for r in rows:
        assert r["HGMMA"] > 0 and r["HMMA"] == 0, r
        assert r["spill_stores"] <= (64 if r["launch"][1] == 4 else 0) and r["shared_bytes"] <= 227 * 1024, r


def test_default_launches_compile_for_sm90_without_spills():
    """The default launches at the real latent (576 = 512 + 64, page 64) as compiled for an H100/H200 (no GPU
    needed; Triton's bundled ptxas): the programs resident a SM each declares, the latent tiles loaded through
    shared memory with cp.async (LDGSTS), no register spills but the one launch that trades 128 bytes for two
    programs a SM. Compiled in a child process:
    kernels imported under TRITON_INTERPRET=1 are interpreter objects that cannot be compiled."""
    cases = [("bfloat16", 16, 1, False), ("bfloat16", 16, 4, False), ("bfloat16", 20, 1, False),
             ("bfloat16", 20, 4, False), ("float16", 128, 2, False), ("float32", 20, 2, False),
             ("bfloat16", 20, 4, True), ("bfloat16", 20, 1, True), ("bfloat16", 128, 2, True)]  # coded: E4M3 rows
    rows = compiled_rows(_SM90_SCRIPT, cases)
    assert len({(r["dtype"], r["hq"], r["splits"], r["coded"]) for r in rows}) == len(cases)
    assert any(r["launch"] == [32, 4, 2] for r in rows)  # the 32-head tile's second launch was compiled
    for r in rows:
        # as many programs resident a SM as the launch declares (the one-wave split count rests on it)
        assert r["programs_per_sm"] >= r["declared"] and r["LDGSTS"] > 0, r
        # the wait for the previous kernel, then the next one let in
        assert r["launch_order"] == ["wait", "launch_dependents"], r
        if r["coded"]:  # the codes' conversion holds a 64-row bf16 tile in registers: a few bytes spilled (96 by
            # the one-split variant, whose loop is as long as the split one's: the spills lie outside it)
            assert r["spill_stores"] <= 128, r
        elif r["block_h"] == 32 and r["launch"] == [32, 4, 2]:  # 255 registers: two programs a SM for 128 bytes
            # spilled (measured the fastest where its wave holds more splits)
            assert r["spill_stores"] <= 128, r
        else:
            assert r["spill_stores"] == 0, r


_SM90_TMA_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import mla_decode

mla_decode.pdl = lambda device: True  # launched as on a Hopper GPU
rows = []
for page, batch, splits, heads in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    with captured_launches() as launches:
        mla_decode.mla_paged_decode(torch.zeros(batch, heads, 576, **bf), torch.zeros(64, page, 1, 576, **bf),
                                    torch.zeros(batch, 4096 // page, dtype=torch.int32),
                                    torch.full((batch,), 4096, dtype=torch.int32), 0.07, 512, num_splits=splits,
                                    tma=True)
    fn, args, options = launches[0]  # the split kernel (the combine follows)
    r = compile_sm90(fn, args, **options)
    rows.append(dict(page=page, heads=heads, tma=args["TMA"], stages=options["num_stages"], **{k: r[k] for k in (
        "registers", "spill_stores", "shared_bytes", "HMMA", "HGMMA", "LDGSTS", "launch_order")},
        tma_loads=r["UTMALDG"]))
print(json.dumps(rows))
"""


def test_the_halves_kernel_compiles_for_sm90_with_tma_loads_where_pages_allow():
    """The ``tma`` kernel's default launch at GLM-4.7-Flash's decode shape (20 heads, 512 + 64), as compiled for an
    H100 / H200: on 64-row pages its whole tiles come by TMA (UTMALDG), only the partial last tile by cp.async; on
    the engine's 16-row pages (64-row tiles) every tile is gathered, in five stages where TMA reads take three, as
    at 16 and 128 heads. No spills, one SM's shared memory; the wait for the previous kernel first."""
    rows = compiled_rows(_SM90_TMA_SCRIPT, [[64, 8, 16, 20], [16, 8, 16, 20], [16, 8, 16, 16], [16, 8, 8, 128]])
    assert [(r["page"], r["heads"], r["tma"], r["stages"]) for r in rows] == [
        (64, 20, True, 3), (16, 20, False, 5), (16, 16, False, 5), (16, 128, False, 5)]
    for r in rows:
        # 64-head tiles take wgmma (HGMMA), narrower ones mma.sync (HMMA)
        assert r["spill_stores"] == 0 and r["HGMMA" if r["heads"] > 32 else "HMMA"] > 0, r
        assert r["shared_bytes"] <= 227 * 1024, r
        assert r["launch_order"] == ["wait", "launch_dependents"], r
        assert (r["tma_loads"] > 0) == r["tma"] and r["LDGSTS"] > 0, r

