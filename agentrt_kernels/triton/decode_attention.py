"""Paged decode attention (one query token per request), split along the context (flash-decoding).

``paged_decode_attention(q, k_cache, v_cache, block_tables, kv_lens, scale, num_splits=None, out=None)``
    q:            [B, Hq, D] fp32 / fp16 / bf16 (last dim contiguous; other strides free)
    k_cache/v_cache: [num_pages, page_size, Hkv, D], same dtype as q; Hq % Hkv == 0
    block_tables: [B, max_pages] int32 page ids; kv_lens: [B] int32 (>= 1; a 0 row yields zeros)
    scale:        softmax scale (python float)
    num_splits:   context splits per request; None: ``two_wave_splits`` of B, Hkv and max_pages * page_size
    out:          optional preallocated [B, Hq, D] output (e.g. a CUDA-graph static buffer)
    returns       out [B, Hq, D] in q's dtype

Kernel 1, grid (B, Hkv, num_splits): one program owns every query head of one KV head group, so each
K/V tile is read from HBM once for the whole group. The group's queries form a [BLOCK_G, D] tile padded
with zero rows to >= 16 (tl.dot's minimum M), and each step reads BLOCK_N context tokens gathered through
the page table (any page size; a tile may span pages), computing S = Q K^T ([BLOCK_G, BLOCK_N]) and
P V with tl.dot (fp16/bf16 operands, fp32 accumulation) and an online softmax in base 2. The split's
token range is derived on the device from kv_len: every request is cut into ``num_splits`` equal,
BLOCK_N-aligned ranges of at least ``min_split_tokens`` (so a short request in a grid sized for long ones,
as in a CUDA graph captured for the longest context, uses few full splits instead of many one-tile ones),
and empty tail splits just emit an empty partial. Partial results are (acc / l, log2-sum-exp) in fp32.

Kernel 2, grid (B, Hq): merges the num_splits partials with max-rescaling. With num_splits == 1 kernel 1
normalises and writes the output directly and kernel 2 is not launched. With ``fused_combine`` kernel 1
counts each KV head's finished splits on an arrival counter (``_common.arrival_counts``; ``last_to_arrive``: a
barrier, then an acquire-release increment after its partial's store) and the split that arrives last merges the
group's partials and resets the counter: no kernel 2.

CUDA-graph safety: no host syncs (no ``.item()``, no reading kv_lens on the host); grid and buffer shapes
depend only on B, Hq, D and num_splits, and the default num_splits only on B, Hkv and block_tables.shape.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import (
    arrival_counts,
    cdiv,
    check_last_dim_contiguous,
    dot_args,
    last_to_arrive,
    next_pow2,
    num_sms,
    pdl,
    pdl_enter,
)

_LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
# Split-kernel programs per SM that the dense default aims at: two full waves of the 4 its default launch keeps
# resident (120 registers x 128 threads, ``python -m benchmarks.kernel_resources``). On an H200 (bf16, 32 / 8
# heads, d128, ``attention_kernels.py --splits``) the fastest split count on long contexts puts ~1024 programs
# on 132 SMs: a few more start a mostly empty third wave, and about half as many (just over one wave) are
# slower too (figures in docs/benchmarks.md).
SPLIT_PROGRAMS_PER_SM = 8
# The device-side floor on a split's length (``min_split_tokens``). 0 keeps every request cut into all
# ``num_splits`` ranges, as decode graphs (captured with the splits of the longest context) cut them, the
# setting the H200 figures in docs/benchmarks.md hold for; ``attention_kernels.py --sweep`` times
# alternatives on the GPU before this default changes.
DEFAULT_MIN_SPLIT_TOKENS = 0
MAX_SPLITS = 64
# Whether the split kernel merges its partials itself (the last split of each KV head to arrive, through an
# arrival counter) instead of a second launch: one launch a layer less, for decode steps whose attention is a
# few microseconds. Off until a GPU measurement shows it faster (``attention_kernels.py --splits`` times both).
FUSED_COMBINE = False


@triton.jit
def split_range(len_ptr, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """A split's slots [start, end) of the request whose length is at ``len_ptr``: equal, BLOCK_N-aligned ranges
    of at least MIN_SPLIT (few full splits for a short request in a grid sized for long ones); a split past the
    end gets an empty range."""
    kv_len = tl.load(len_ptr)
    per_split = ((kv_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    per_split = tl.maximum(per_split, MIN_SPLIT)
    start = split * per_split
    return start, tl.minimum(start + per_split, kv_len)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, FUSED_COMBINE: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    start, end = split_range(lens_ptr + b, split, BLOCK_N, NUM_SPLITS, MIN_SPLIT)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    dot_ty = tl.float32 if UPCAST else k_ptr.dtype.element_ty
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(dot_ty)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        n_mask = tok < end
        page = tl.load(bt_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = (tok % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision=PRECISION) * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty), input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # mid_o: [B, Hq, NUM_SPLITS, HEAD_DIM] fp32; mid_lse: [B, Hq, NUM_SPLITS] fp32 (log2 domain)
        row = (b.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)
        if FUSED_COMBINE:
            # the last of the group's splits to finish merges them (its acquire sees the others' partials)
            # and re-arms the counter for the next launch
            counter = counter_ptr + b.to(tl.int64) * tl.num_programs(1) + kvh
            if last_to_arrive(counter, NUM_SPLITS):
                _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b, head, g_mask, d_mask, offs_d, num_q_heads,
                             stride_ob, stride_oh, HEAD_DIM, NUM_SPLITS, BLOCK_S, BLOCK_G, BLOCK_D)
                tl.store(counter, 0)


@triton.jit
def _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b, head, g_mask, d_mask, offs_d, num_q_heads, stride_ob,
                 stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_decode_combine_kernel`` for one KV head's query heads [BLOCK_G], inside the split kernel."""
    rows = (b.to(tl.int64) * num_q_heads + head) * NUM_SPLITS  # [BLOCK_G]: each head's first split
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(mid_lse_ptr + rows[:, None] + offs_s[None, :], mask=g_mask[:, None] & (offs_s < NUM_SPLITS)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (kv_len == 0): output zeros
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    denom = tl.where(denom > 0.0, denom, 1.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        w = tl.exp2(tl.load(mid_lse_ptr + rows + split, mask=g_mask, other=float("-inf"), cache_modifier=".cg") - m)
        o = tl.load(mid_o_ptr + (rows + split)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        acc += o * w[:, None]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_combine_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (kv_len == 0): output zeros
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    o = tl.load(mid_o_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, sm_count: int = 132) -> int:
    """Splits per request so that B * Hkv * splits programs put ~4 programs on each of ``sm_count`` SMs: the
    base the coded and low-rank kernels' split factors were tuned against (the dense kernel takes
    ``two_wave_splits``).

    Each split keeps >= MIN_TOKENS_PER_SPLIT tokens of the longest request (so the fp32 partials stay a
    few percent of the KV bytes read) and there are at most MAX_SPLITS. (Measured on an H200, bf16,
    Hq/Hkv = 32/8, D = 128: B=8 x 4096 tokens peaks at 8 splits, B=32 x 2048 at 2-4, B=1 x 8192 at 32-64.)
    """
    programs = max(1, batch * num_kv_heads)
    want = cdiv(4 * sm_count, programs)
    by_len = max(1, max_kv_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


def two_wave_splits(batch: int, num_kv_heads: int, max_kv_len: int, sm_count: int = 132) -> int:
    """The dense split kernel's default: the most splits whose B * Hkv * splits programs fit in
    SPLIT_PROGRAMS_PER_SM programs a SM, two full waves (a partial last wave leaves most SMs idle while it runs),
    each split keeping >= MIN_TOKENS_PER_SPLIT tokens of the longest request, at most MAX_SPLITS. (On an H200
    it beats ``choose_num_splits``' ~4 a SM on long contexts and leaves short ones about even; figures in
    docs/benchmarks.md.)"""
    want = (SPLIT_PROGRAMS_PER_SM * sm_count) // max(1, batch * num_kv_heads)
    by_len = max_kv_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(want, by_len, MAX_SPLITS))


def split_partials(out: torch.Tensor, num_kv_heads: int, max_kv_len: int, num_splits: int | None,
                   split_factor: int = 1) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(splits, mid_o [B, Hq, S, D] fp32, mid_lse [B, Hq, S] fp32) for a split decode kernel writing ``out``
    [B, Hq, D]: unless given, ``split_factor`` times ``choose_num_splits`` (at most MAX_SPLITS); with one split
    the kernel writes ``out`` itself and both buffers are ``out`` (unused)."""
    batch, num_q_heads, head_dim = out.shape
    if num_splits is None:
        num_splits = min(MAX_SPLITS, split_factor * choose_num_splits(batch, num_kv_heads, max_kv_len,
                                                                      num_sms(out.device)))
    num_splits = max(1, int(num_splits))
    if num_splits == 1:
        return 1, out, out
    mid_o = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    mid_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=out.device)
    return num_splits, mid_o, mid_lse


def combine_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge ``split_partials``' buffers into ``out`` (nothing to do with one split)."""
    batch, num_q_heads, head_dim = out.shape
    if mid_o.dim() != 4:  # one split: the kernel wrote its output itself
        return
    num_splits, block_d = mid_o.shape[2], next_pow2(head_dim)
    _decode_combine_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)),
        num_warps=4 if block_d * next_pow2(num_splits) >= 2048 else 2, PDL=(on := pdl(out.device)),
        launch_pdl=on,
    )


def _default_block_n(block_d: int) -> int:
    return 64 if block_d <= 128 else 32


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
    fused_combine: bool = FUSED_COMBINE,
) -> torch.Tensor:
    """q [B, Hq, D] attends to the first kv_lens[b] slots of request b's pages -> [B, Hq, D]. With
    ``fused_combine`` the last split of each KV head merges the partials itself (no second launch)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, kd = k_cache.shape
    assert kd == head_dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert block_tables.shape[0] == batch and kv_lens.shape == (batch,), (block_tables.shape, kv_lens.shape)
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("kv_lens", kv_lens)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == q.shape, (out.shape, q.shape)
        check_last_dim_contiguous("out", out)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    block_d = next_pow2(head_dim)
    block_n = block_n or _default_block_n(block_d)
    max_kv_len = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = two_wave_splits(batch, num_kv_heads, max_kv_len, num_sms(q.device))
    num_splits, mid_o, mid_lse = split_partials(out, num_kv_heads, max_kv_len, num_splits)
    upcast, precision = dot_args(_decode_split_kernel, q.dtype)
    fused = fused_combine and num_splits > 1
    counters = arrival_counts(q.device, batch * num_kv_heads) if fused else kv_lens  # (unused when not fused)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, kv_lens, out, mid_o, mid_lse, counters,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_SPLIT=max(0, int(min_split_tokens)),
        UPCAST=upcast, PRECISION=precision, FUSED_COMBINE=fused, BLOCK_S=max(2, next_pow2(num_splits)),
        num_warps=num_warps, num_stages=num_stages, PDL=(on := pdl(q.device)), launch_pdl=on,
    )
    if not fused:
        combine_splits(mid_o, mid_lse, out)
    return out


