"""The MLA paged prefill / extend kernel (``agentrt_kernels.triton.mla_prefill``) against a dense torch computation:
each request's latent rows gathered through its page table, logits q k^T * scale in fp32, the causal limit
kv_len - q_len + j + 1 for query j, softmax, times the rows' first Dv channels. Runs compiled on a GPU, or in
Triton's CPU interpreter (TRITON_INTERPRET=1) at tiny sizes."""

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.triton.mla_prefill import launch_config, mla_paged_prefill  # noqa: E402
from tests.kernels.sm90_compile import compiled_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) for attention outputs of O(1) magnitude, as tests/kernels/test_mla_decode_kernel.py's
ATTN_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2e-2)}

# (kv_len, q_len) per request: a decode row (q_len 1) next to a whole prompt, an empty padding request, a chunk
# that starts mid-context, and kv_lens that are not multiples of any page size
MIXED = [(70, 1), (37, 37), (0, 0), (150, 45), (9, 9)]


def _case(seed, dtype, reqs, hq, dk, page_size, extra_pages=3, pad_pages=1):
    """q [T, Hq, Dk], latent [P, page_size, 1, Dk], block tables over shuffled pages, kv_lens and query_start_loc
    int32. Every latent row no request may see is NaN (the slots past kv_len in a request's last page, and the
    spare pages that pad the block-table rows): a kernel that reads past kv_len gets NaN into its output (p = 0
    times a NaN value)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(max(n, 1) / page_size) for n, _ in reqs]
    num_pages = sum(need) + extra_pages
    latent = torch.randn(num_pages, page_size, 1, dk, generator=g).to(dtype)
    q_lens = [ql for _, ql in reqs]
    q = torch.randn(sum(q_lens), hq, dk, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    spare = perm[sum(need):]
    latent[spare] = float("nan")
    bt = spare[torch.randint(0, extra_pages, (len(reqs), max(need) + pad_pages), generator=g)]
    start = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[start:start + n]
        latent[bt[i, n - 1], reqs[i][0] - (n - 1) * page_size:] = float("nan")
        start += n
    kv_lens = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, latent, bt.to(torch.int32), kv_lens, qsl)]


def _dense(q, latent, bt, kv_lens, qsl, scale, dv, causal=True, limit_shift=0):
    """(out [T, Hq, Dv] fp32, lse [T, Hq] natural log) of each request's queries over its gathered rows;
    ``limit_shift`` moves the causal limit (a deliberately wrong reference)."""
    rows_all = latent.reshape(latent.shape[0], latent.shape[1], -1).float()
    page_size = rows_all.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(kv_lens.tolist()):
        s, e = qsl[b].item(), qsl[b + 1].item()
        if n == 0 or e == s:
            continue
        rows = rows_all[bt[b, : math.ceil(n / page_size)].long()].flatten(0, 1)[:n]  # [n, Dk]
        logits = torch.einsum("thd,nd->thn", q[s:e].float(), rows) * scale
        if causal:
            limit = n - (e - s) + torch.arange(e - s, device=q.device) + 1 + limit_shift
            hidden = torch.arange(n, device=q.device)[None, :] >= limit[:, None]  # [q_len, n]
            logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
        out[s:e] = torch.softmax(logits, dim=-1) @ rows[:, :dv]
        lse[s:e] = torch.logsumexp(logits, dim=-1)
    return out, lse


def _close(got, want, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


CASES = [
    # dtype, hq, dk, dv, page_size, causal, block_n: every dtype x page size x head count x mask mode at a small
    # latent (Dk 48 = 32 value channels + 16 rope channels), tiles spanning pages (16) and pages of several tiles
    (dtype, hq, 48, 32, page_size, causal, 32 if page_size == 16 else 16)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for page_size in (16, 64)
    for hq in (16, 20)
    for causal in (True, False)
] + [
    # widths that are not powers of two (value part 40 -> 64, rope part 12 -> 16), no rope part, and the real
    # DeepSeek-V3 / GLM-4.7-Flash latent (512 + 64)
    (torch.float16, 20, 52, 40, 16, True, 16),
    (torch.float32, 16, 32, 32, 64, True, None),
    (torch.bfloat16, 16, 576, 512, 64, True, None),
]


@pytest.mark.parametrize("dtype,hq,dk,dv,page_size,causal,block_n", CASES)
def test_mla_prefill_matches_dense(dtype, hq, dk, dv, page_size, causal, block_n):
    reqs = MIXED if dk < 256 else [(70, 1), (83, 21), (0, 0), (5, 5)]
    q, latent, bt, lens, qsl = _case(zlib.crc32(f"{dtype}-{hq}-{dk}-{page_size}-{causal}".encode()), dtype, reqs,
                                     hq, dk, page_size)
    scale = 192 ** -0.5  # DeepSeek's (qk_nope 128 + rope 64) ** -0.5
    out = torch.full((q.shape[0], hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((q.shape[0], hq), float("nan"), dtype=torch.float32, device=DEVICE)
    got = mla_paged_prefill(q, latent, bt, lens, qsl, scale, dv, causal=causal,
                            max_query_len=max(ql for _, ql in reqs), out=out, lse=lse, block_n=block_n)
    assert got is out and got.shape == (q.shape[0], hq, dv) and got.dtype == dtype
    want, want_lse = _dense(q, latent, bt, lens, qsl, scale, dv, causal)
    _close(got, want, dtype)
    torch.testing.assert_close(lse, want_lse, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-4)


@pytest.mark.parametrize("block_m,max_query_len", [(None, 26), (32, None), (16, 40)])
def test_many_heads_strided_q_and_grid_bounds(block_m, max_query_len):
    """Hq 40: one tile of 40 heads in 64 rows, or several balanced head tiles (2 x 20 for 32 rows, 3 x 14 for 16);
    q a strided slice of a wider buffer, the latent given as [P, ps, Dk], max_query_len exact, left to the host,
    or larger than needed (a grid sized for a bigger batch: the extra query blocks exit)."""
    dtype, hq, dk, dv, page_size = torch.float16, 40, 48, 32, 16
    reqs = [(40, 6), (13, 1), (26, 26)]
    q_wide, latent, bt, lens, qsl = _case(9, dtype, reqs, hq, dk + 16, page_size)
    q = q_wide[..., :dk]
    latent = latent[..., :dk].contiguous()[:, :, 0]
    got = mla_paged_prefill(q, latent, bt, lens, qsl, 0.2, dv, max_query_len=max_query_len, block_m=block_m)
    _close(got, _dense(q, latent, bt, lens, qsl, 0.2, dv)[0], dtype)


def test_launch_config():
    """Row tiles of token x head pairs: all heads of a few tokens, or balanced head tiles of one token."""
    def tiles(hq, max_q, dtype=torch.bfloat16, dv=512):
        c = launch_config(hq, max_q, dv, dtype)
        return c["BLOCK_H"], c["BLOCK_Q"], c["BLOCK_M"], c["HEAD_TILES"], c["BLOCK_N"], c["num_warps"]

    assert tiles(16, 4096) == (16, 4, 64, 1, 32, 8)  # DeepSeek-V3 at TP 8
    assert tiles(20, 4096) == (20, 3, 64, 1, 32, 8)  # GLM-4.7-Flash: 60 of 64 rows
    assert tiles(128, 4096, torch.float16) == (64, 1, 64, 2, 32, 8)
    assert tiles(16, 1) == (16, 1, 16, 1, 32, 8)  # decode-like batches: one token of 16 heads
    assert tiles(20, 2) == (20, 2, 64, 1, 32, 8)
    assert tiles(20, 4096, torch.float32) == (10, 1, 16, 2, 16, 8)
    assert tiles(20, 4096, torch.float32, dv=32) == (20, 3, 64, 1, 32, 4)  # small widths
    assert tiles(40, 4096, dv=32) == (40, 1, 64, 1, 32, 4)
    assert launch_config(40, 4096, 32, torch.float16, block_m=16)["HEAD_TILES"] == 3


def test_comparison_is_sharp_for_scale_and_causal_limit():
    """The kernel matches the dense result, and the check would catch a wrong scale or a causal limit off by one
    either way; the kernel itself follows a changed scale."""
    dtype, hq, dk, dv, page_size = torch.float32, 16, 48, 32, 16
    reqs = [(120, 50), (33, 33)]
    q, latent, bt, lens, qsl = _case(11, dtype, reqs, hq, dk, page_size)
    scale = dk ** -0.5
    got = mla_paged_prefill(q, latent, bt, lens, qsl, scale, dv, max_query_len=50, block_n=16)
    want, _ = _dense(q, latent, bt, lens, qsl, scale, dv)
    _close(got, want, dtype)

    def misses(other):  # a first query with no visible slot gives NaN rows: a miss too
        diff = (got.float() - other).abs()
        return bool(diff.isnan().any() or diff.max() > 1e-3)

    assert misses(_dense(q, latent, bt, lens, qsl, scale * 1.1, dv)[0])
    assert misses(_dense(q, latent, bt, lens, qsl, scale, dv, limit_shift=1)[0])
    assert misses(_dense(q, latent, bt, lens, qsl, scale, dv, limit_shift=-1)[0])
    assert misses(_dense(q, latent, bt, lens, qsl, scale, dv, causal=False)[0])
    other = mla_paged_prefill(q, latent, bt, lens, qsl, scale * 1.1, dv, max_query_len=50, block_n=16)
    _close(other, _dense(q, latent, bt, lens, qsl, scale * 1.1, dv)[0], dtype)
    assert misses(other.float())


def test_empty_context_rows_and_empty_batch():
    """Non-causal rows of a request with no context come out as zeros with lse -inf; no tokens: nothing runs."""
    dtype, hq, dk, dv = torch.float32, 16, 48, 32
    q, latent, bt, lens, qsl = _case(4, dtype, [(0, 2), (5, 3)], hq, dk, 16)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    got = mla_paged_prefill(q, latent, bt, lens, qsl, 0.3, dv, causal=False, max_query_len=3, lse=lse)
    assert torch.all(got[:2] == 0) and torch.all(lse[:2] == float("-inf"))
    want, want_lse = _dense(q, latent, bt, lens, qsl, 0.3, dv, causal=False)
    _close(got, want, dtype)
    torch.testing.assert_close(lse[2:], want_lse[2:])
    empty = mla_paged_prefill(q[:0], latent, bt[:0], lens[:0], qsl[:1], 0.3, dv, max_query_len=0)
    assert empty.shape == (0, hq, dv)


def test_rejects_bad_shapes():
    q, latent, bt, lens, qsl = _case(5, torch.float32, [(5, 5), (7, 2)], 16, 48, 16)
    with pytest.raises(AssertionError):
        mla_paged_prefill(q, latent.expand(-1, -1, 2, -1), bt, lens, qsl, 0.1, 32)  # two KV heads
    with pytest.raises(AssertionError):
        mla_paged_prefill(q, latent, bt, lens, qsl, 0.1, 64)  # value_dim > Dk
    with pytest.raises(AssertionError):
        mla_paged_prefill(q, latent, bt, lens, qsl[:-1], 0.1, 32)  # query_start_loc is [B + 1]
    with pytest.raises(ValueError, match="kv_lens"):
        mla_paged_prefill(q, latent, bt, torch.stack([lens, lens], 1)[:, 0], qsl, 0.1, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mla_prefill_cuda_graph():
    """Captured once for a token budget and max_query_len, replayed with new queries, page tables, kv lens and
    query_start_loc written into the static inputs (no host syncs inside)."""
    dtype, hq, dk, dv, page_size = torch.bfloat16, 20, 576, 512, 64
    reqs = [(300, 64)] * 3  # the capture's shapes: the replays' page tables index the same pages
    q, latent, bt, lens, qsl = _case(21, dtype, reqs, hq, dk, page_size, extra_pages=8)
    latent = torch.where(latent.isnan(), torch.randn_like(latent), latent)  # the replays use other page tables
    out = torch.empty(q.shape[0], hq, dv, dtype=dtype, device=DEVICE)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_paged_prefill(q, latent, bt, lens, qsl, 0.07, dv, max_query_len=64, out=out, lse=lse)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_paged_prefill(q, latent, bt, lens, qsl, 0.07, dv, max_query_len=64, out=out, lse=lse)
    for seed, new in ((1, [(1, 1), (190, 64), (64, 63)]), (2, [(100, 10), (0, 0), (256, 64)])):
        q2, _, bt2, lens2, qsl2 = _case(seed, dtype, [(300, 64)] * 3, hq, dk, page_size, extra_pages=8)
        q.copy_(q2)
        bt.copy_(bt2[:, : bt.shape[1]])
        lens.copy_(torch.tensor([n for n, _ in new], dtype=torch.int32))
        qsl.copy_(torch.tensor([0, *torch.tensor([ql for _, ql in new]).cumsum(0).tolist()], dtype=torch.int32))
        graph.replay()
        used = qsl[-1].item()
        want, want_lse = _dense(q, latent, bt, lens, qsl, 0.07, dv)
        _close(out[:used], want[:used], dtype)
        torch.testing.assert_close(lse[:used], want_lse[:used], atol=2e-2, rtol=1e-4)


_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import compile_sm90
from agentrt_kernels.triton import mla_prefill as m
rows = []
for dtype, hq, max_q in json.loads(sys.argv[1]):
    tdtype = getattr(torch, dtype)
    cfg = m.launch_config(hq, max_q, 512, tdtype)
    ty = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    args = dict(q_ptr=ty, kv_ptr=ty, o_ptr=ty, bt_ptr="*i32", lens_ptr="*i32", qsl_ptr="*i32", lse_ptr="*fp32",
                scale_log2=0.1, num_heads=hq, stride_qt=hq * 576, stride_qh=576, stride_kp=64 * 576, stride_ks=576,
                stride_btb=1037, stride_ot=hq * 512, stride_oh=512, stride_lt=hq,
                **{k: v for k, v in cfg.items() if k.isupper()}, DV=512, BLOCK_DV=512, DK=576, BLOCK_DR=64,
                HAS_REST=True, PAGE_SIZE=64, CAUSAL=True, UPCAST=False,
                PRECISION="ieee" if dtype == "float32" else "tf32", STORE_LSE=True)
    r = compile_sm90(m._mla_prefill_kernel, args, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    rows.append(dict(dtype=dtype, hq=hq, max_q=max_q, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                     warps=cfg["num_warps"], stages=cfg["num_stages"], **{k: r[k] for k in (
                         "registers", "spill_stores", "shared_bytes", "programs_per_sm", "LDGSTS")}))
print(json.dumps(rows))
"""


def test_default_launches_compile_for_sm90_without_spills():
    """The default tiles at the real latent (576 = 512 + 64, page 64) as compiled for an H100/H200 (no GPU
    needed; Triton's bundled ptxas): no register spills and the latent tiles loaded through shared memory with
    cp.async (LDGSTS), for 16 (DeepSeek-V3 at TP 8), 20 (GLM-4.7-Flash) and 128 heads, long prompts and
    decode-like batches (smaller row tiles), fp32 too. Compiled in a child process: kernels imported under
    TRITON_INTERPRET=1 are interpreter objects that cannot be compiled."""
    cases = [("bfloat16", 16, 4096), ("bfloat16", 20, 4096), ("bfloat16", 128, 4096), ("float16", 16, 4096),
             ("bfloat16", 16, 1), ("bfloat16", 20, 1), ("bfloat16", 16, 2), ("float32", 20, 4096)]
    rows = compiled_rows(_SM90_SCRIPT, cases)
    assert len(rows) == len(cases)
    for r in rows:
        print(r)
        assert r["spill_stores"] == 0 and r["LDGSTS"] > 0, r
