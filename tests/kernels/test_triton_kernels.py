"""Triton kernels vs torch references, on fresh random inputs.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported), so sizes stay tiny. With a GPU the same tests run compiled on CUDA tensors. The interpreter
truncates fp32 -> bf16 instead of rounding to nearest, so bf16 checks allow an ulp or two.
"""

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from engine.models.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from engine.models.layers import silu_and_mul as torch_silu_and_mul  # noqa: E402
from agentrt_kernels.torch_ref import paged_attention  # noqa: E402
from agentrt_kernels.triton import (  # noqa: E402
    apply_rotary,
    choose_num_splits,
    fused_moe,
    moe_align_block_size,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_and_store,
    silu_and_mul,
    store_kv,
    two_wave_splits,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) for attention-like outputs of O(1) magnitude
ATTN_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2e-2)}


def _seed(*key) -> None:
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def _randn(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _close(out: torch.Tensor, ref: torch.Tensor, tol) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all()
    atol, rtol = tol
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _bf16_ulp_tol(dtype):
    """Elementwise kernels: exact in fp32/fp16, about an ulp in bf16 (interpreter truncation)."""
    return {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]


def _paged_cache(num_pages, page_size, num_kv_heads, head_dim, dtype):
    return (_randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype),
            _randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype))


def _block_tables(kv_lens, page_size, num_pages, pad_to=None):
    """Random disjoint, shuffled (non-contiguous) pages per request; padding entries are 0."""
    need = [math.ceil(n / page_size) for n in kv_lens]
    width = max(max(need), pad_to or 0)
    perm = torch.randperm(num_pages).tolist()
    assert sum(need) <= num_pages
    rows, pos = [], 0
    for n in need:
        rows.append(perm[pos:pos + n] + [0] * (width - n))
        pos += n
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


# --- store_kv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype,src_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_store_kv(cache_dtype, src_dtype):
    _seed("store", cache_dtype, src_dtype)
    num_pages, page_size, hkv, d, t = 7, 4, 2, 64, 9
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, cache_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    qkv = _randn(t, (4 + 2 * hkv) * d, dtype=src_dtype)  # strided k/v views, as the models produce
    k = qkv[:, 4 * d:(4 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(num_pages * page_size, device=DEVICE)[:t]
    slots[2] = -1
    slots[7] = -1
    store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    ref_k.view(-1, hkv, d).index_copy_(0, slots[keep], k[keep].to(cache_dtype))
    ref_v.view(-1, hkv, d).index_copy_(0, slots[keep], v[keep].to(cache_dtype))
    tol = (0, 0) if cache_dtype == src_dtype else (1e-3, 1e-3)
    _close(k_cache, ref_k, tol)
    _close(v_cache, ref_v, tol)


# --- decode attention --------------------------------------------------------------------------------


DECODE_CASES = [
    # dtype, group, head_dim, page_size, num_splits, block_n
    (torch.float32, 1, 64, 4, 1, 16),
    (torch.float32, 2, 128, 16, 3, 16),
    (torch.float32, 4, 64, 8, None, None),
    (torch.float16, 1, 128, 4, 2, 16),
    (torch.float16, 2, 64, 16, 1, None),
    (torch.float16, 4, 64, 4, 4, 16),
    (torch.bfloat16, 1, 64, 8, 3, 16),
    (torch.bfloat16, 2, 64, 4, 1, 16),
    (torch.bfloat16, 4, 128, 16, 2, None),
    (torch.float16, 3, 64, 4, 2, 16),  # non-power-of-two group
    (torch.float32, 2, 64, 1, 2, 16),  # page size 1
    (torch.float16, 2, 64, 32, 5, 16),  # pages larger than a tile; more splits than some requests need
]


@pytest.mark.parametrize("min_split", [0, 32])  # 32: long requests split, short ones fill one or two splits
@pytest.mark.parametrize("dtype,group,head_dim,page_size,num_splits,block_n", DECODE_CASES)
def test_paged_decode_attention(dtype, group, head_dim, page_size, num_splits, block_n, min_split):
    _seed("decode", dtype, group, head_dim, page_size, num_splits, block_n)
    hkv = 2
    hq = hkv * group
    kv_lens = [1, 37, 16, 70, 5]  # 1, non-multiples of the page size, several tiles
    num_pages = sum(math.ceil(n / page_size) for n in kv_lens) + 5
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, head_dim, dtype)
    bt = _block_tables(kv_lens, page_size, num_pages, pad_to=math.ceil(80 / page_size))
    q = _randn(len(kv_lens), hq, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(q, k_cache, v_cache, bt, _i32(kv_lens), scale, num_splits=num_splits,
                                 out=out, block_n=block_n, min_split_tokens=min_split)
    assert got is out
    ref, _ = paged_attention(q, k_cache, v_cache, bt, kv_lens, [1] * len(kv_lens), scale)
    _close(out, ref, ATTN_TOL[dtype])


def test_paged_decode_attention_strided_q_and_empty_rows():
    """q as a strided slice of a packed qkv; kv_len 0 (CUDA-graph padding) rows come out as zeros."""
    _seed("decode-strided")
    dtype, hkv, group, d, page_size = torch.float16, 2, 2, 64, 8
    kv_lens = [9, 0, 30]
    num_pages = 12
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    bt = _block_tables([max(n, 1) for n in kv_lens], page_size, num_pages)
    qkv = _randn(3, (hkv * group + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, :hkv * group * d].view(3, hkv * group, d)
    for splits in (1, 3):
        out = paged_decode_attention(q, k_cache, v_cache, bt, _i32(kv_lens), 0.125, num_splits=splits, block_n=16)
        assert torch.all(out[1] == 0)
        ref, _ = paged_attention(q[[0, 2]], k_cache, v_cache, bt[[0, 2]], [9, 30], [1, 1], 0.125)
        _close(out[[0, 2]], ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype,group,num_splits",
                         [(torch.float32, 4, 3), (torch.float16, 3, 8), (torch.bfloat16, 2, 5)])
def test_paged_decode_attention_fused_combine(dtype, group, num_splits):
    """The last split of each KV head merges the partials itself: the same output as the two-launch merge and
    the reference, empty rows zeros, and the arrival counters back at zero for the next launch."""
    from agentrt_kernels.triton._common import _COUNTERS

    _seed("decode-fused-combine", dtype, group, num_splits)
    hkv, d, page_size = 2, 64, 8
    kv_lens = [37, 0, 70, 5]
    num_pages = sum(math.ceil(max(n, 1) / page_size) for n in kv_lens) + 3
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    bt = _block_tables([max(n, 1) for n in kv_lens], page_size, num_pages)
    q = _randn(len(kv_lens), hkv * group, d, dtype=dtype)
    outs = [paged_decode_attention(q, k_cache, v_cache, bt, _i32(kv_lens), 0.125, num_splits=num_splits,
                                   block_n=16, fused_combine=fused) for fused in (False, True, True)]
    assert torch.all(outs[1][1] == 0)
    keep = [0, 2, 3]
    ref, _ = paged_attention(q[keep], k_cache, v_cache, bt[keep], [kv_lens[i] for i in keep], [1] * 3, 0.125)
    _close(outs[1][keep], ref, ATTN_TOL[dtype])
    _close(outs[1], outs[0], (1e-6, 1e-6))
    assert torch.equal(outs[2], outs[1])  # the second launch found its counters re-armed
    stream = torch.cuda.current_stream().cuda_stream if q.is_cuda else 0
    assert not _COUNTERS[(q.device, stream)][-1].any()


def test_attention_kernels_refuse_strided_lengths():
    """The kernels index lengths by request: a strided [B] view (a layer's column of a [B, layers] array)
    is refused with a ValueError naming it, not read with the wrong stride."""
    k_cache, v_cache = _paged_cache(8, 4, 2, 16, torch.float32)
    bt = _block_tables([5, 7], 4, 8)
    lens = _i32([[5, 5], [7, 7]])[:, 0]  # stride 2
    with pytest.raises(ValueError, match="kv_lens"):
        paged_decode_attention(_randn(2, 4, 16), k_cache, v_cache, bt, lens, 0.25)
    with pytest.raises(ValueError, match="kv_lens"):
        paged_prefill_attention(_randn(2, 4, 16), k_cache, v_cache, bt, lens, _i32([0, 1, 2]), 0.25, causal=True,
                                max_query_len=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_paged_decode_attention_cuda_graph():
    """Captured once, replayed with new q, page tables and kv lens written into the static inputs."""
    _seed("decode-graph")
    dtype, hkv, group, d, page_size, batch, max_pages = torch.bfloat16, 2, 4, 128, 16, 4, 8
    num_pages = batch * max_pages + 4
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    q = _randn(batch, hkv * group, d, dtype=dtype)
    bt = _block_tables([max_pages * page_size] * batch, page_size, num_pages)
    lens = _i32([max_pages * page_size] * batch)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.1, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.1, out=out)
    for kv_lens in ([1, 17, 128, 60], [100, 3, 16, 127]):
        q.copy_(_randn(batch, hkv * group, d, dtype=dtype))
        bt.copy_(_block_tables([max_pages * page_size] * batch, page_size, num_pages))
        lens.copy_(_i32(kv_lens))
        graph.replay()
        ref, _ = paged_attention(q, k_cache, v_cache, bt, kv_lens, [1] * batch, 0.1)
        _close(out, ref, ATTN_TOL[dtype])


def test_a_grid_sized_for_long_contexts_serves_short_ones():
    """As in a decode graph captured for the longest context: 64 splits, requests of 1 to 300 slots, a
    256-token minimum split length (most splits empty for the short ones) equals the reference."""
    _seed("decode-many-splits")
    dtype, hkv, group, d, page_size = torch.float16, 2, 4, 64, 16
    kv_lens = [1, 40, 300, 257]
    num_pages = sum(math.ceil(n / page_size) for n in kv_lens) + 3
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    bt = _block_tables(kv_lens, page_size, num_pages)
    q = _randn(len(kv_lens), hkv * group, d, dtype=dtype)
    got = paged_decode_attention(q, k_cache, v_cache, bt, _i32(kv_lens), 0.125, num_splits=64, block_n=16,
                                 min_split_tokens=256)
    ref, _ = paged_attention(q, k_cache, v_cache, bt, kv_lens, [1] * len(kv_lens), 0.125)
    _close(got, ref, ATTN_TOL[dtype])


def test_choose_num_splits():
    # big batches already fill the GPU
    assert choose_num_splits(256, 8, 4096, 132) == 1
    # few long requests are split to put ~4 programs on every SM, bounded by MAX_SPLITS
    assert choose_num_splits(8, 8, 4096, 132) == 9
    assert choose_num_splits(1, 8, 32768, 132) == 64
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64
    # short contexts are not split below ~256 tokens per split
    assert choose_num_splits(1, 8, 300, 132) == 1
    assert choose_num_splits(2, 8, 1024, 132) == 4


def test_two_wave_splits():
    # the dense kernel's default: as many splits as fit 8 programs on each of 132 SMs (two waves of 4)
    assert two_wave_splits(8, 8, 32768, 132) == 16  # 1024 programs; 17 would start a third wave
    assert two_wave_splits(32, 8, 8192, 132) == 4
    assert two_wave_splits(64, 8, 4096, 132) == 2
    assert two_wave_splits(256, 8, 4096, 132) == 1  # 2048 programs: already more than two waves
    assert two_wave_splits(1, 8, 131072, 132) == 64  # bounded by MAX_SPLITS
    assert two_wave_splits(8, 8, 2048, 132) == 8  # and by >= 256 tokens a split
    assert two_wave_splits(1, 8, 300, 132) == 1
    for batch in (1, 3, 8, 17, 64, 130):
        splits = two_wave_splits(batch, 8, 1 << 20, 132)
        assert batch * 8 * splits <= max(8 * 132, batch * 8) and (splits == 64 or batch * 8 * (splits + 1) > 8 * 132)


# --- prefill attention -------------------------------------------------------------------------------


PREFILL_CASES = [
    # dtype, group, head_dim, page_size, causal, block_m, block_n
    (torch.float32, 1, 64, 4, True, 16, 16),
    (torch.float32, 2, 128, 8, True, 32, 16),
    (torch.float32, 4, 64, 16, False, None, None),
    (torch.float16, 1, 128, 4, True, None, 16),
    (torch.float16, 4, 64, 8, True, 32, 32),
    (torch.float16, 2, 64, 4, False, 16, 16),
    (torch.bfloat16, 2, 64, 16, True, 16, 16),
    (torch.bfloat16, 4, 128, 4, True, None, None),
    (torch.float16, 3, 64, 8, True, 32, 16),  # non-power-of-two group
    (torch.float32, 2, 64, 1, True, 16, 16),  # page size 1
    (torch.float16, 2, 64, 32, True, 16, 16),  # pages larger than a tile
]


@pytest.mark.parametrize("dtype,group,head_dim,page_size,causal,block_m,block_n", PREFILL_CASES)
def test_paged_prefill_attention(dtype, group, head_dim, page_size, causal, block_m, block_n):
    _seed("prefill", dtype, group, head_dim, page_size, causal, block_m, block_n)
    hkv = 2
    hq = hkv * group
    query_lens = [5, 1, 19, 8, 3]
    cached = [0, 6, 13, 0, 30]  # fresh prefill, decode-like, chunked extends
    kv_lens = [q + c for q, c in zip(query_lens, cached)]
    num_pages = sum(math.ceil(n / page_size) for n in kv_lens) + 3
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, head_dim, dtype)
    bt = _block_tables(kv_lens, page_size, num_pages)
    q = _randn(sum(query_lens), hq, head_dim, dtype=dtype)
    qsl = _i32([0] + torch.tensor(query_lens).cumsum(0).tolist())
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    got = paged_prefill_attention(q, k_cache, v_cache, bt, _i32(kv_lens), qsl, scale, causal=causal,
                                  max_query_len=max(query_lens), out=out, block_m=block_m, block_n=block_n)
    assert got is out
    ref, _ = paged_attention(q, k_cache, v_cache, bt, kv_lens, query_lens, scale, causal=causal)
    _close(out, ref, ATTN_TOL[dtype])


def test_prefill_matches_decode_for_single_queries():
    _seed("prefill-as-decode")
    dtype, hkv, group, d, page_size = torch.float32, 2, 4, 64, 4
    kv_lens = [3, 21, 1]
    num_pages = 12
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    bt = _block_tables(kv_lens, page_size, num_pages)
    q = _randn(3, hkv * group, d, dtype=dtype)
    pre = paged_prefill_attention(q, k_cache, v_cache, bt, _i32(kv_lens), _i32([0, 1, 2, 3]), 0.1,
                                  max_query_len=1)
    dec = paged_decode_attention(q, k_cache, v_cache, bt, _i32(kv_lens), 0.1, num_splits=2, block_n=16)
    _close(pre, dec, ATTN_TOL[dtype])


# --- rms_norm / silu_and_mul -------------------------------------------------------------------------


def _torch_rms_norm(x, weight, eps):
    norm = RMSNorm(x.shape[-1], eps).to(DEVICE)
    norm.weight.data = weight
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    _seed("rms", dtype)
    eps = 1e-6
    x = _randn(6, 96, dtype=dtype)  # non-power-of-two hidden size
    w = (1 + 0.1 * _randn(96)).to(dtype)
    _close(rms_norm(x, w, eps), _torch_rms_norm(x, w, eps), _bf16_ulp_tol(dtype))

    res = _randn(6, 96, dtype=dtype)
    out, new_res = rms_norm(x, w, eps, res)
    _close(new_res, x + res, (0, 0) if dtype != torch.bfloat16 else _bf16_ulp_tol(dtype))
    _close(out, _torch_rms_norm(x + res, w, eps), _bf16_ulp_tol(dtype))

    # in place residual update
    res2 = res.clone()
    out2, new_res2 = rms_norm(x, w, eps, res2, residual_out=res2)
    assert new_res2 is res2
    _close(out2, out, (0, 0))

    # q/k-norm: per-head norm over a strided [T, H, D] view of a packed qkv
    qkv = _randn(5, 4 * 64 + 2 * 64, dtype=dtype)
    q = qkv[:, :4 * 64].view(5, 4, 64)
    wq = (1 + 0.1 * _randn(64)).to(dtype)
    _close(rms_norm(q, wq, eps), _torch_rms_norm(q, wq, eps), _bf16_ulp_tol(dtype))


def test_rms_norm_fp32_weight_promotes():
    _seed("rms-promote")
    x = _randn(3, 64, dtype=torch.float16)
    w = 1 + 0.1 * _randn(64)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float32
    _close(out, _torch_rms_norm(x, w, 1e-5), (1e-6, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_rms_norm_is_transformers_qwen3_next_norm(dtype):
    """The fused kernel's Qwen3-Next mode against transformers' own module: plain, after the residual add, and
    per head over a strided q view (the hybrids' q/k norms)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    _seed("rms-zero", dtype)
    eps = 1e-6

    def hf(x, w):
        norm = Qwen3NextRMSNorm(x.shape[-1], eps).to(DEVICE, dtype)
        norm.weight.data = w
        return norm(x)

    x, res = _randn(6, 96, dtype=dtype), _randn(6, 96, dtype=dtype)
    w = (0.1 * _randn(96)).to(dtype)  # the weight is stored around zero: the scale is 1 + w
    got = rms_norm(x, w, eps, zero_centered=True)
    assert got.dtype == dtype
    _close(got, hf(x, w), _bf16_ulp_tol(dtype))
    out, new_res = rms_norm(x, w, eps, res, zero_centered=True)
    _close(new_res, x + res, (0, 0) if dtype != torch.bfloat16 else _bf16_ulp_tol(dtype))
    _close(out, hf(x + res, w), _bf16_ulp_tol(dtype))
    qkv = _randn(5, 4 * 64 + 2 * 64, dtype=dtype)
    q = qkv[:, :4 * 64].view(5, 4, 64)
    wq = (0.1 * _randn(64)).to(dtype)
    _close(rms_norm(q, wq, eps, zero_centered=True), hf(q, wq), _bf16_ulp_tol(dtype))
    # the engine's layer takes this path on every device
    from engine.models.gated_deltanet import ZeroCenteredRMSNorm
    layer = ZeroCenteredRMSNorm(96, eps).to(DEVICE, dtype)
    layer.weight.data = w
    _close(layer(x), hf(x, w), _bf16_ulp_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    _seed("silu", dtype)
    x = 3 * _randn(7, 2 * 80, dtype=dtype)
    _close(silu_and_mul(x), torch_silu_and_mul(x), _bf16_ulp_tol(dtype))
    x3 = 3 * _randn(6, 2 * 2048, dtype=dtype)[:, :2 * 1100]  # strided rows, two column blocks
    _close(silu_and_mul(x3), torch_silu_and_mul(x3), _bf16_ulp_tol(dtype))


# --- rotary ------------------------------------------------------------------------------------------


def _rotary(dtype, head_dim, max_pos=128, scaling=None):
    rot = RotaryEmbedding(head_dim, 10000.0, scaling, max_pos).to(DEVICE)
    rot.cos_cache = rot.cos_cache.to(dtype)  # as built under the model's default dtype
    rot.sin_cache = rot.sin_cache.to(dtype)
    return rot


def _pages_and_stored(t, num_pages, page_size, ref_k, v, skip, dtype):
    """Random slots for ``t`` tokens (slot ``skip`` -1: not stored), a paged pool, and the pool as storing ``ref_k``
    and ``v`` at those slots leaves it: (slots, k_cache, v_cache, ref_kc, ref_vc)."""
    hkv, d = v.shape[1:]
    slots = torch.randperm(num_pages * page_size, device=DEVICE)[:t]
    slots[skip] = -1
    k_cache, v_cache = _paged_cache(num_pages, page_size, hkv, d, dtype)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref_kc.view(-1, hkv, d).index_copy_(0, slots[keep], ref_k[keep])
    ref_vc.view(-1, hkv, d).index_copy_(0, slots[keep], v[keep])
    return slots, k_cache, v_cache, ref_kc, ref_vc


def _qkv(t, hq, hkv, d, dtype):
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    return q, k, v


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 64)])
def test_apply_rotary(dtype, head_dim):
    _seed("rope", dtype, head_dim)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    rot = _rotary(dtype, head_dim, scaling=scaling)
    q, k, _ = _qkv(9, 6, 2, head_dim, dtype)
    positions = torch.randint(0, 128, (9,), device=DEVICE)
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    got_q, got_k = apply_rotary(positions, q, k, rot.cos_cache, rot.sin_cache)
    assert got_q is q and got_k is k
    _close(q, ref_q, _bf16_ulp_tol(dtype))
    _close(k, ref_k, _bf16_ulp_tol(dtype))


def test_apply_rotary_fp32_cache_low_precision_q():
    """cos/sin kept in fp32 with fp16 q: the math runs in fp32 and is stored back in fp16."""
    _seed("rope-mixed")
    rot = _rotary(torch.float32, 64)
    q, k, _ = _qkv(5, 4, 2, 64, torch.float16)
    positions = torch.randint(0, 128, (5,), device=DEVICE)
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    apply_rotary(positions, q, k, rot.cos_cache, rot.sin_cache)
    _close(q, ref_q.half(), (0, 0))
    _close(k, ref_k.half(), (0, 0))


@pytest.mark.parametrize("dtype,inplace_k", [(torch.float32, False), (torch.float16, True), (torch.bfloat16, False)])
def test_rotary_and_store(dtype, inplace_k):
    _seed("rope-store", dtype, inplace_k)
    hq, hkv, d, t, page_size, num_pages = 4, 2, 64, 7, 4, 5
    rot = _rotary(dtype, d)
    q, k, v = _qkv(t, hq, hkv, d, dtype)
    k_orig = k.clone()
    positions = torch.randint(0, 128, (t,), device=DEVICE)
    ref_q, ref_k = rot(positions, q.clone(), k.clone())
    slots, k_cache, v_cache, ref_kc, ref_vc = _pages_and_stored(t, num_pages, page_size, ref_k, v, 3, dtype)
    rotary_and_store(positions, q, k, v, rot.cos_cache, rot.sin_cache, k_cache, v_cache, slots,
                     inplace_k=inplace_k)
    tol = _bf16_ulp_tol(dtype)
    _close(q, ref_q, tol)
    _close(k_cache, ref_kc, tol)
    _close(v_cache, ref_vc, (0, 0))
    _close(k, ref_k if inplace_k else k_orig, tol if inplace_k else (0, 0))


@pytest.mark.parametrize("dtype,hq,hkv,d", [(torch.float32, 4, 2, 64), (torch.float16, 6, 2, 96),
                                            (torch.bfloat16, 3, 3, 128)])
def test_rotary_with_qk_norm(dtype, hq, hkv, d):
    """Per-head q/k RMSNorm fused before the rotation equals RMSNorm then RotaryEmbedding (Qwen3's q/k norm)."""
    _seed("rope-qk-norm", dtype, hq, hkv, d)
    t, page_size, num_pages, eps = 7, 4, 5, 1e-6
    rot = _rotary(dtype, d)
    q_norm, k_norm = RMSNorm(d, eps).to(DEVICE), RMSNorm(d, eps).to(DEVICE)
    q_norm.weight.data = (1 + 0.3 * _randn(d)).to(dtype)
    k_norm.weight.data = (1 + 0.3 * _randn(d)).to(dtype)
    norm = dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=eps)
    q, k, v = _qkv(t, hq, hkv, d, dtype)
    q, k = 3 * q, k + 0.5  # rows of different scales and nonzero means
    positions = torch.randint(0, 128, (t,), device=DEVICE)
    ref_q, ref_k = rot(positions, q_norm._norm(q), k_norm._norm(k))  # torch norms (on a GPU too), then RoPE
    tol = _bf16_ulp_tol(dtype)

    q1, k1 = q.clone(), k.clone()
    apply_rotary(positions, q1, k1, rot.cos_cache, rot.sin_cache, **norm)
    _close(q1, ref_q, tol)
    _close(k1, ref_k, tol)

    slots, k_cache, v_cache, ref_kc, ref_vc = _pages_and_stored(t, num_pages, page_size, ref_k, v, 2, dtype)
    k_orig = k.clone()
    rotary_and_store(positions, q, k, v, rot.cos_cache, rot.sin_cache, k_cache, v_cache, slots, **norm)
    _close(q, ref_q, tol)
    _close(k_cache, ref_kc, tol)
    _close(v_cache, ref_vc, (0, 0))
    _close(k, k_orig, (0, 0))


@pytest.mark.parametrize("dtype,hq,hkv,d,rd", [(torch.float32, 4, 2, 64, 16), (torch.bfloat16, 6, 2, 128, 32),
                                               (torch.float16, 3, 1, 96, 48)])
def test_partial_rotary_with_zero_centered_norm(dtype, hq, hkv, d, rd):
    """Qwen3.5 / Qwen3-Next full attention: the zero-centred per-head norms over all D channels, then RoPE on the
    first ``rd`` (transformers' Qwen3NextRMSNorm and apply_rotary_pos_emb), on q as the strided half of the packed
    query-and-gate projection; without the norms only the rotary channels change; stored with v into pages."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, apply_rotary_pos_emb

    _seed("rope-partial", dtype, hq, hkv, d, rd)
    t, page_size, num_pages, eps = 7, 4, 5, 1e-6
    rot = RotaryEmbedding(d, 10000.0, None, 128, rotary_dim=rd).to(DEVICE)
    rot.cos_cache, rot.sin_cache = rot.cos_cache.to(dtype), rot.sin_cache.to(dtype)
    q_gate = 3 * _randn(t, hq, 2 * d, dtype=dtype)
    q = q_gate[..., :d]  # head stride 2d, as GatedAttention's query
    kv = _randn(t, 2 * hkv * d, dtype=dtype)
    k, v = kv[:, :hkv * d].view(t, hkv, d) + 0.5, kv[:, hkv * d:].view(t, hkv, d)
    positions = torch.randint(0, 128, (t,), device=DEVICE)
    weights = [(0.2 * _randn(d)).to(dtype) for _ in range(2)]  # stored around zero: the scale is 1 + w

    def hf_norm(x, w):
        norm = Qwen3NextRMSNorm(d, eps).to(DEVICE, dtype)
        norm.weight.data = w
        return norm(x)

    cos = torch.cat([rot.cos_cache[positions]] * 2, dim=-1)
    sin = torch.cat([rot.sin_cache[positions]] * 2, dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(hf_norm(q, weights[0]), hf_norm(k, weights[1]), cos, sin)
    tol = _bf16_ulp_tol(dtype)

    plain_q, plain_k = apply_rotary_pos_emb(q, k, cos, sin)
    q1, k1 = q.clone(), k.clone()
    apply_rotary(positions, q1, k1, rot.cos_cache, rot.sin_cache)
    _close(q1, plain_q, tol)
    _close(k1, plain_k, tol)
    _close(q1[..., rd:], q[..., rd:], (0, 0))

    norm = dict(q_norm_weight=weights[0], k_norm_weight=weights[1], norm_eps=eps, zero_centered=True)
    q1, k1 = q_gate.clone()[..., :d], k.clone()
    apply_rotary(positions, q1, k1, rot.cos_cache, rot.sin_cache, **norm)
    _close(q1, ref_q, tol)
    _close(k1, ref_k, tol)

    slots, k_cache, v_cache, ref_kc, ref_vc = _pages_and_stored(t, num_pages, page_size, ref_k, v, 2, dtype)
    gate_before = q_gate[..., d:].clone()
    rotary_and_store(positions, q, k, v, rot.cos_cache, rot.sin_cache, k_cache, v_cache, slots, **norm)
    _close(q, ref_q, tol)
    _close(q_gate[..., d:], gate_before, (0, 0))  # the gate half of each head untouched
    _close(k_cache, ref_kc, tol)
    _close(v_cache, ref_vc, (0, 0))


@pytest.mark.parametrize("method,config", [("snapkv", {"budget": 24, "window": 4}),
                                           ("quest", {"token_budget": 16, "dense_layers": 0})])
def test_methods_see_the_fused_paths_strided_queries_as_the_plain_paths(tiny_dirs, monkeypatch, method, config):
    """With the fused RoPE + store kernel the hybrids' full-attention layers hand the runner q as the strided half
    of the query-and-gate projection, normalized and rotated in place; a method's votes and selections over those
    queries equal the plain path's (norms, RoPE, then the store): same tokens and logprobs over a three-turn
    chain (the kernel forced on the CPU under the interpreter)."""
    import random

    import engine.storage.dense
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.chain_helpers import random_tokens, run_chain_turn

    def turns(fused: bool):
        monkeypatch.setattr(engine.storage.dense, "fuse_rotary_store", lambda kv: fused)
        # a pool of its own size: on a GPU the default sizes the pool from the memory left, which the other
        # engine of this test still holds
        eng = LLMEngine(EngineConfig(tiny_dirs["qwen3_5"], dtype="float32", device=str(DEVICE), page_size=4,
                                     max_num_batched_tokens=16, method=method, method_config=config,
                                     enforce_eager=True, num_pages=256))
        rng, history, outs = random.Random(3), [], []
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)
        for _ in range(3):
            history = history + random_tokens(rng, 40)
            out = run_chain_turn(eng, "c", history, params)
            outs.append((out.token_ids, out.logprobs))
            history = history + out.token_ids
        return outs

    plain, fused = turns(False), turns(True)
    assert [t for t, _ in plain] == [t for t, _ in fused]
    for (_, a), (_, b) in zip(plain, fused):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


# --- fused MoE ---------------------------------------------------------------------------------------


def _dense_moe(x, w_gate_up, w_down, topk_weights, topk_ids):
    """Dense fp32 loop over experts: every expert runs on the tokens that picked it."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        tok, j = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok].float() @ w_gate_up[e].float().T
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (h @ w_down[e].float().T) * topk_weights[tok, j, None].float())
    return out


MOE_CASES = [
    # dtype, tokens, experts, top_k, hidden, inter, config
    (torch.float32, 9, 4, 2, 64, 32, None),
    (torch.float32, 20, 8, 3, 48, 40, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)),
    (torch.float16, 13, 6, 2, 64, 48, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)),
    (torch.float16, 1, 4, 1, 32, 32, None),
    (torch.bfloat16, 11, 4, 2, 64, 32, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1)),
]


@pytest.mark.parametrize("dtype,tokens,experts,top_k,hidden,inter,config", MOE_CASES)
def test_fused_moe(dtype, tokens, experts, top_k, hidden, inter, config):
    _seed("moe", dtype, tokens, experts, top_k, hidden, inter)
    x = _randn(tokens, hidden, dtype=dtype)
    w_gate_up = (_randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w_down = (_randn(experts, hidden, inter) / inter**0.5).to(dtype)
    probs = torch.softmax(_randn(tokens, experts), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    topk_weights = topk_weights.to(dtype)
    out = fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, config=config)
    assert out.dtype == dtype
    ref = _dense_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}[dtype]
    _close(out, ref, tol)


@pytest.mark.parametrize("dtype,tokens,experts,top_k,hidden,inter,config", [
    c for c in MOE_CASES if c[3] > 1] + [(torch.bfloat16, 8, 9, 5, 96, 32, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32,
                                                                                GROUP_M=8))])
def test_the_top_k_sum_inside_the_down_gemm_is_the_separate_sums_bits(dtype, tokens, experts, top_k, hidden, inter,
                                                                        config):
    """``SUM_IN_DOWN``: each column block's last program of the down GEMM to arrive (empty expert blocks arrive
    too) adds every token's top_k rows in slot order: the same bits as the separate top-k sum launch. Three calls
    in a row on one set of arrival counters, which are zero after each."""
    from agentrt_kernels.triton import _common

    _seed("moe-sum-in-down", dtype, tokens, experts, top_k)
    w_gate_up = (_randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w_down = (_randn(experts, hidden, inter) / inter**0.5).to(dtype)
    for _ in range(3):
        x = _randn(tokens, hidden, dtype=dtype)
        topk_weights, topk_ids = torch.topk(torch.softmax(_randn(tokens, experts), dim=-1), top_k, dim=-1)
        topk_weights = topk_weights.to(dtype)
        apart, inside = (fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids,
                                   config={**(config or {}), "SUM_IN_DOWN": fold}) for fold in (False, True))
        assert torch.equal(inside, apart)
    stream = torch.cuda.current_stream().cuda_stream if DEVICE.type == "cuda" else 0
    assert all(int(c.abs().sum()) == 0 for c in _common._COUNTERS[(x.device, stream)])


def test_moe_decode_config_override(monkeypatch):
    """``AGENTRT_MOE_DECODE_CONFIG``: its keys replace the decode-size default's (one 16-row block an expert) and
    nothing else; bad JSON, other keys and non-positive values are refused naming the key; and the kernel under an
    override still equals the dense experts."""
    from agentrt_kernels.triton import moe

    override = moe.decode_config_override('{"BLOCK_N": 16, "num_stages": 2, "BLOCK_N_DOWN": 64}')
    monkeypatch.setattr(moe, "DECODE_CONFIG", override)
    assert moe._default_config(8 * 5, 65) == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_M=8, num_warps=4,
                                                  num_stages=2, BLOCK_N_DOWN=64)
    assert moe._default_config(64 * 64, 8)["BLOCK_M"] == 128 and "BLOCK_N_DOWN" not in moe._default_config(4096, 8)
    assert moe.decode_config_override("") == {} and moe.decode_config_override(None) == {}
    for text, named in (("{", "not JSON"), ("[16]", "JSON object"), ('{"BLOCK_M": 32}', "'BLOCK_M'"),
                        ('{"num_warps": 0}', "num_warps"), ('{"BLOCK_K": 64.0}', "BLOCK_K")):
        with pytest.raises(ValueError, match=named):
            moe.decode_config_override(text)
    _seed("moe-override")
    monkeypatch.setattr(moe, "DECODE_CONFIG", moe.decode_config_override('{"BLOCK_N": 16, "BLOCK_K": 32}'))
    x = _randn(5, 64)
    w_gate_up, w_down = _randn(6, 64, 64) / 8, _randn(6, 64, 32) / 6
    topk_weights, topk_ids = torch.topk(torch.softmax(_randn(5, 6), dim=-1), 2, dim=-1)
    _close(fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids),
           _dense_moe(x, w_gate_up, w_down, topk_weights, topk_ids), (1e-5, 1e-5))


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(10, 3, 5, 4), (700, 2, 6, 16)])
def test_moe_align_block_size(tokens, top_k, experts, block_m):
    _seed("moe-align", tokens, top_k, experts, block_m)
    topk_ids = torch.stack([torch.randperm(experts, device=DEVICE)[:top_k] for _ in range(tokens)])
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, experts, block_m)
    num_slots = tokens * top_k
    assert sorted_ids.shape == (expert_ids.shape[0] * block_m,)
    real = sorted_ids[sorted_ids < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))  # every slot exactly once
    flat = topk_ids.flatten()
    blocks = sorted_ids.view(-1, block_m)
    for blk, e in zip(blocks.tolist(), expert_ids.tolist()):
        members = [s for s in blk if s < num_slots]
        if e == experts:
            assert not members  # past the end: only padding
        else:
            assert all(flat[s].item() == e for s in members)
    assert expert_ids.tolist() == sorted(expert_ids.tolist())
    counts = torch.bincount(flat, minlength=experts).tolist()
    assert expert_ids.tolist().count(experts) == expert_ids.numel() - sum(-(-c // block_m) for c in counts)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5", "qwen3_next"])
def test_engine_with_the_fused_rotary_store_equals_rotate_then_store(arch, tiny_dirs, monkeypatch):
    """The model hands q/k before RoPE to the runner (``attention_rotary``) and the cache rotates while it stores
    (``write_rotated``): with the fused kernel forced on (the interpreter on a CPU), the KV written and the greedy
    tokens equal RoPE followed by the plain store, over chunked prompts, a prefix hit and decode steps. Qwen3's
    q/k norms run in the kernel too (the hybrids' zero-centred ones with their partial rotary); the fp32 sum of
    squares adds in another order than torch's, so their KV agrees to a few fp32 ulps rather than bit for bit."""
    import engine.storage.dense
    import agentrt_kernels.triton
    from engine import LLM, SamplingParams

    def run():
        llm = LLM(tiny_dirs[arch], dtype="float32", device=str(DEVICE), page_size=4, max_num_batched_tokens=16,
                  num_pages=64, enforce_eager=True)
        g = torch.Generator().manual_seed(5)
        ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (23, 9)]
        outs = llm.generate(ps + [ps[0][:17] + [7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        return [o.token_ids for o in outs], llm.engine.cache.storage.kv.clone(), [o.num_cached_tokens for o in outs]

    monkeypatch.setattr(engine.storage.dense, "fuse_rotary_store", lambda kv: False)
    want_tokens, want_kv, _ = run()
    calls = []
    fused = agentrt_kernels.triton.rotary_and_store
    monkeypatch.setattr(agentrt_kernels.triton, "rotary_and_store", lambda *a, **kw: calls.append(kw) or fused(*a, **kw))
    monkeypatch.setattr(engine.storage.dense, "fuse_rotary_store", lambda kv: True)
    got_tokens, got_kv, cached = run()
    assert len(calls) > 10 and max(cached) > 0
    assert all(("q_norm_weight" in kw) == (arch != "llama") for kw in calls)
    assert all(kw.get("zero_centered", False) == arch.startswith("qwen3_") for kw in calls)
    assert got_tokens == want_tokens
    if arch != "llama":
        torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got_kv, want_kv)
