"""Paged decode attention for multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash), absorbed form.

``mla_paged_decode(q, latent, block_tables, kv_lens, scale, value_dim, num_splits=None, out=None)``
    q:            [B, Hq, Dk] fp32 / fp16 / bf16 (last dim contiguous; other strides free), Dk = kv_lora_rank +
                  rope_dim (e.g. 512 + 64 = 576): the absorbed query (q_nope W_uk, q_rope) of each head
    latent:       [num_pages, page_size, 1, Dk] or [num_pages, page_size, Dk], same dtype as q: ONE cached row per
                  token (the compressed KV c_kv followed by the roped key k_pe), shared by every query head
    block_tables: [B, max_pages] int32 page ids; kv_lens: [B] int32 (>= 1; a 0 row yields zeros)
    scale:        softmax scale (python float)
    value_dim:    Dv <= Dk: the values are the FIRST Dv channels of each latent row (V is a slice of K)
    num_splits:   context splits per request; None: ``choose_launch``'s (one wave of programs; see Tiles); a
                  count given keeps the launch chosen for the default one
    out:          optional preallocated [B, Hq, Dv] output (e.g. a CUDA-graph static buffer)
    returns       out [B, Hq, Dv] in q's dtype

This is multi-query attention with one KV head: keys are whole latent rows (Dk channels), values their first
Dv channels. Kernel 1, grid (cdiv(Hq, BLOCK_H), num_splits, B): one program owns a tile of BLOCK_H query heads
(>= 16 rows, tl.dot's minimum M; heads past Hq are masked zero rows) and one split of one request's context.
Each step gathers BLOCK_N latent rows through the page table (any page size; a tile may span pages) and reads
them from HBM once for both products: S = Q K^T is two tl.dots, over the value channels [0, Dv) (the
[BLOCK_N, BLOCK_DV] tile) and over the rest [Dv, Dk) (a [BLOCK_N, BLOCK_DR] tile), each padded to a power of
two with masked channels (Dk = 576 -> 512 + 64, no padding); P V is a tl.dot of the probabilities with the very
same [BLOCK_N, BLOCK_DV] tile. fp16/bf16 dot operands, fp32 accumulation, online softmax in base 2. The head
tiles of one (split, request) are neighbours in the launch order (axis 0), so their re-reads of the same
latent rows hit L2. The split's token range is derived on the device from kv_len exactly as in
``decode_attention``: equal, BLOCK_N-aligned ranges of at least ``min_split_tokens``; empty tail splits emit an
empty partial. Partials are (acc / l, log2-sum-exp) in fp32, laid out as ``decode_attention.split_partials``.

Tiles (``default_block_h``, ``_launch_candidates``, ``choose_launch``): 16, 32 or 64 heads a program (the
fewest that hold Hq); for Dv >= 256 the launches the GPU sweep (``benchmarks.mla_decode_sweep``) found fastest,
each with the programs a SM holds; a call takes the one whose single wave of programs holds the most context
splits (``mla_num_splits``: B * head tiles * splits programs, at most one wave). Small widths (tests) take 64
rows and 4 warps. Every knob can be overridden per call.

``keys_as_rows`` transposes both products (S^T = K Q^T, O^T = V^T P^T, the softmax along the rows' axis): the
tile of latent rows becomes the dots' M, which Hopper's wgmma takes 64 at a time, where a head tile (20 heads
padded to 32) takes mma.sync. Tested against the dense reference and compiled for sm_90a; not a default:
``benchmarks.mla_decode_sweep`` measured it slower than the heads-as-rows launches (step ``mlasweeprows``).

Kernel 2, grid (B, Hq): merges the num_splits partials with max-rescaling, one split row [Dv] at a time (no
[splits, Dv] tile, so Dv = 512 with 64 splits stays in registers). With num_splits == 1 kernel 1 normalises and
writes the output directly and kernel 2 is not launched.

CUDA-graph safety: no host syncs (no ``.item()``, no reading kv_lens on the host); grid and buffer shapes
depend only on B, Hq, Dk, Dv and num_splits, and the default num_splits only on B, Hq and block_tables.shape.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2, num_sms, pdl, pdl_enter
from agentrt_kernels.triton.decode_attention import (
    DEFAULT_MIN_SPLIT_TOKENS,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    split_partials,
)
from agentrt_kernels.triton.fitting_launch import launch_fitting
from agentrt_kernels.triton.mla_decode_tma import MAX_BOX, _mla_split_tma_kernel, tma_descriptors, tma_fits, tma_layout
from agentrt_kernels.triton.mla_tiles import row_starts, split_program, store_split_lse, store_split_values

_LOG2E = 1.4426950408889634
# ``mla_paged_decode(tma=None)`` on compute capability 9+: AGENTRT_MLA_TMA=1 always takes the halves kernel,
# 0 never; unset, ``halves_by_default`` decides
TMA_CHOICE = os.environ.get("AGENTRT_MLA_TMA")
# the halves kernel by default where its one wave holds at most this many splits a request (long splits)
HALVES_MAX_SPLITS = 4


@triton.jit
def _mla_split_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, sv_ptr, sr_ptr,
    scale_log2, num_heads,
    stride_qb, stride_qh,
    stride_kp, stride_ks,
    stride_sp, stride_ss,
    stride_btb,
    stride_ob, stride_oh,
    BLOCK_H: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, DK: tl.constexpr, BLOCK_DR: tl.constexpr, HAS_REST: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, CODED: tl.constexpr, KEYS_AS_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b, split, start, end, head, h_mask = split_program(lens_ptr, num_heads, BLOCK_H, BLOCK_N, NUM_SPLITS, MIN_SPLIT)
    offs_v = tl.arange(0, BLOCK_DV)  # value channels [0, DV)
    offs_r = DV + tl.arange(0, BLOCK_DR)  # the rest of the key [DV, DK) (the rope part)
    offs_n = tl.arange(0, BLOCK_N)
    v_mask = offs_v < DV
    r_mask = offs_r < DK

    dot_ty = tl.float32 if UPCAST else q_ptr.dtype.element_ty
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
    q_v = tl.load(q_rows + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0).to(dot_ty)
    if HAS_REST:
        q_r = tl.load(q_rows + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(dot_ty)

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    if KEYS_AS_ROWS:  # S^T = K Q^T and O^T = V^T P^T: the rows' tile is the dots' M (wgmma's 64 a warpgroup)
        tl.static_assert(not CODED, "the coded rows keep the heads as the dots' rows")
        acc_t = tl.full([BLOCK_DV, BLOCK_H], 0.0, dtype=tl.float32)
        q_v_t = tl.trans(q_v)
        if HAS_REST:
            q_r_t = tl.trans(q_r)
        for n0 in range(start, end, BLOCK_N):
            n_mask, page, slot, rows = row_starts(bt_row, kv_ptr, n0, offs_n, end, PAGE_SIZE, stride_kp, stride_ks)
            kv = tl.load(rows[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0)
            kv = kv.to(dot_ty)
            s_t = tl.dot(kv, q_v_t, input_precision=PRECISION)  # [BLOCK_N, BLOCK_H]
            if HAS_REST:
                kr = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0)
                s_t += tl.dot(kr.to(dot_ty), q_r_t, input_precision=PRECISION)
            s_t = tl.where(n_mask[:, None], s_t * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kv), p.to(dot_ty), input_precision=PRECISION)
            m_i = m_new
        acc = tl.trans(acc_t)
    else:
        acc = tl.full([BLOCK_H, BLOCK_DV], 0.0, dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n_mask, page, slot, rows = row_starts(bt_row, kv_ptr, n0, offs_n, end, PAGE_SIZE, stride_kp, stride_ks)
            # the value channels: K's first DV channels and all of V, read once
            kv = tl.load(rows[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0)
            if CODED:  # E4M3 codes, exact in fp16 / bf16; each row's scales applied to its logits and probabilities
                kv = kv.to(tl.float8e4nv, bitcast=True)
                sv = tl.load(sv_ptr + page * stride_sp + slot * stride_ss, mask=n_mask, other=0.0)
            kv = kv.to(dot_ty)
            qk = tl.dot(q_v, tl.trans(kv), input_precision=PRECISION)
            if CODED:
                qk = qk * sv[None, :]
            if HAS_REST:
                kr = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0)
                if CODED:
                    sr = tl.load(sr_ptr + page * stride_sp + slot * stride_ss, mask=n_mask, other=0.0)
                    qk += tl.dot(q_r, tl.trans(kr.to(tl.float8e4nv, bitcast=True).to(dot_ty)),
                                 input_precision=PRECISION) * sr[None, :]
                else:
                    qk += tl.dot(q_r, tl.trans(kr.to(dot_ty)), input_precision=PRECISION)
            qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if CODED:
                p = p * sv[None, :]  # l_i summed the probabilities themselves; the values' scale rides on p
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), kv, input_precision=PRECISION)
            m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_split_values(out_ptr, mid_o_ptr, b, head, split, num_heads, stride_ob, stride_oh, offs_v,
                       h_mask[:, None] & v_mask[None, :], o, DV, NUM_SPLITS)
    store_split_lse(mid_lse_ptr, b, head, split, num_heads, h_mask, m_i, l_i, NUM_SPLITS)


@triton.jit
def _mla_combine_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS  # this head's first split
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, BLOCK_DV)
    v_mask = offs_v < DV
    lse = tl.load(mid_lse_ptr + row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (kv_len == 0): output zeros
    denom = tl.sum(tl.exp2(lse - m), 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(mid_lse_ptr + row + s) - m)
        acc += tl.load(mid_o_ptr + (row + s) * DV + offs_v, mask=v_mask, other=0.0) * w
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_v, (acc / denom).to(out_ptr.dtype.element_ty),
             mask=v_mask)


# Latent row codes the decode kernel reads (``TensorCodec.kernel_format``): E4M3 codes, one fp32 scale for the
# latent channels and one for the rotary key
LATENT_ROW_FORMATS = ("e4m3-latent-row",)


def coded_rows(fmt: str, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(codes, row_scales) for ``mla_paged_decode`` from a latent row codec's fields in format ``fmt``."""
    if fmt not in LATENT_ROW_FORMATS:
        raise ValueError(f"no MLA decode kernel reads latent rows in format {fmt!r} (it reads {LATENT_ROW_FORMATS})")
    return fields["codes"], (fields["scale"], fields["rope_scale"])


def default_block_h(num_heads: int) -> int:
    """Query heads a program owns: the fewest of 16 (tl.dot's minimum rows), 32 and 64 that hold all of them,
    64 at most. Every head tile re-reads the request's latent rows (from L2 when its neighbours just did), so
    GLM-4.7-Flash's 20 heads take one tile of 32 rather than two of 16, and 128 heads two tiles of 64."""
    return 16 if num_heads <= 16 else 32 if num_heads <= 32 else 64


# A launch of the split kernel: (BLOCK_N, num_warps, num_stages, programs resident a SM)
Launch = tuple[int, int, int, int]


def _launch_candidates(block_h: int, block_dv: int, dtype: torch.dtype, coded: bool = False,
                       keys_as_rows: bool = False, tma: bool = False, gathered: bool = False) -> list[Launch]:
    """The launches ``mla_paged_decode`` chooses among for a head tile, each with the programs a SM holds at once
    (registers and shared memory as ptxas reports them for sm_90a, Triton 3.6;
    ``benchmarks.kernel_resources.compile_sm90``). For latent widths of 256 and more (MLA's 512 + 64), bf16 /
    fp16 rows, the fastest of ``benchmarks.mla_decode_sweep`` (docs/benchmarks.md) at 16, 20 (GLM-4.7-Flash) and
    128 heads (DeepSeek-V3): 16 heads x 32 rows on 4 warps (~210 registers, two programs a SM); for 32-head tiles
    32 x 64 on 8 warps, five stages (~176 registers, 185 KB of shared memory: one a SM; the rotary channels' loads
    pipelined too, which two stages leave synchronous), the fastest where a batch's splits fill one wave of those
    (bs8 @ 4K), and 32 x 32 on 4 warps (255 registers, a few bytes spilled: two a SM), the fastest where the wave
    of two a SM holds more splits (bs32 @ 4K, bs8 @ 32K); 64 x 32 on 8 warps, five stages (wgmma, ~246 registers,
    185 KB: one a SM; 1.6-1.7x the 16-row tile). The latent loads are pipelined through shared memory (cp.async);
    GPUs with less of it than Hopper take fewer stages or rows (``fitting_launch``). fp32 latents take 16 x 16
    (110 registers; fp32 dots run on the FMA units). ``coded`` (E4M3 rows converted in registers): 64 rows on 8
    warps, one a SM, for 16- and 32-head tiles (a few bytes spilled; 1.2-1.9x the 16- and 32-row tiles). Small
    widths (tests): 64 rows on 4 warps, four a SM assumed (not a shape the sweep or the sm_90a compile checks
    cover). ``keys_as_rows`` (16-bit rows): 64 rows on 8 warps, three stages (wgmma, ~191 registers, 185 KB: one a
    SM; five stages would not fit). ``tma`` (``mla_decode_tma``'s kernel, two accumulators of half the values):
    reading by TMA, three stages (243 registers), 16 x 32 on 4 warps, 32 x 64 and 64 x 16 on 8 (one a SM);
    ``gathered`` (the pool's pages do not hold whole 64-row tiles, so the halves kernel gathers them, as on the
    engine's 16-row pages), five stages: 16 x 32 on 4 warps (~179 registers, two a SM), 32 x 64 and 64 x 32 on 8
    (182 and ~232 registers, 185 KB; one a SM) -- the sweep's fastest at each tile, bs8 and bs32 at 4K, bs8 at
    32K (32-head tiles bs1 to bs32)."""
    if block_dv < 256:
        return [(64, 4, 2, 4)]
    if tma:
        if gathered:
            return [{16: (32, 4, 5, 2), 32: (64, 8, 5, 1)}.get(block_h, (32, 8, 5, 1))]
        return [{16: (32, 4, 3, 2), 32: (64, 8, 3, 1)}.get(block_h, (16, 8, 3, 1))]
    if keys_as_rows and dtype != torch.float32:
        return [(64, 8, 3, 1)]
    if dtype == torch.float32:
        return [(16, 8, 2, 2)]
    if coded and block_h <= 32:
        return [(64, 8, 2, 1)]
    if block_h == 16:
        return [(32, 4, 2, 2)]
    if block_h == 32:
        return [(64, 8, 5, 1), (32, 4, 2, 2)]
    return [(32, 8, 5, 1)]


def mla_num_splits(batch: int, head_tiles: int, max_kv_len: int, sm_count: int = 132,
                   programs_per_sm: int = 1) -> int:
    """Default split count: the most splits whose B * head_tiles * splits programs run in one wave
    (``programs_per_sm`` resident on each of ``sm_count`` SMs), each split keeping >= MIN_TOKENS_PER_SPLIT tokens
    of the longest request, at most MAX_SPLITS. One wave: the sweep's split counts past it (a second, partly
    filled wave) measured slower than the wave's own (bs8 @ 4K, docs/benchmarks.md)."""
    want = (programs_per_sm * sm_count) // max(1, batch * head_tiles)
    by_len = max_kv_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(want, by_len, MAX_SPLITS))


def halves_by_default(batch: int, head_tiles: int, max_kv_len: int, sm_count: int, block_h: int,
                      choice: str | None = None, gathered: bool = False) -> bool:
    """Whether ``mla_paged_decode(tma=None)`` takes the halves kernel (``mla_decode_tma``) for 16-bit rows on
    compute capability 9+: ``choice`` "1" (AGENTRT_MLA_TMA) always, "0" never, else where its tiles are
    ``gathered`` (pages that do not hold whole 64-row tiles: its five-stage launches were the fastest at 16, 32
    and 64 heads a tile, bs8 and bs32 at 4K, bs8 at 32K, on 16-row pages) and a call's head tiles fit one wave
    of one program a SM (past that, unmeasured, the gather kernel's launches take it), or, reading by TMA (three
    stages), for 32-head tiles (17-32 heads, the tile measured there) where its one wave holds at most
    ``HALVES_MAX_SPLITS`` splits a request: it costs more a split and less a tile of rows, and on an H100 at
    GLM-4.7-Flash's 20 heads it was faster at bs32 @ 4K (4 splits of 16 tiles) and not at bs8 (16 splits of 4;
    docs/benchmarks.md)."""
    if choice in ("0", "1"):
        return choice == "1"
    if gathered:
        return batch * head_tiles <= sm_count
    if block_h != 32:
        return False
    launch = _launch_candidates(block_h, 512, torch.bfloat16, tma=True)[0]
    return mla_num_splits(batch, head_tiles, max_kv_len, sm_count, launch[3]) <= HALVES_MAX_SPLITS


def choose_launch(candidates: list[Launch], batch: int, head_tiles: int, max_kv_len: int,
                  sm_count: int) -> tuple[Launch, int]:
    """(launch, num_splits): the candidate whose one wave holds the most programs at its split count (the most
    parallel work the context allows, without a second wave); ties go to the first (fewer, wider programs)."""
    best, best_programs = None, -1
    for launch in candidates:
        splits = mla_num_splits(batch, head_tiles, max_kv_len, sm_count, launch[3])
        programs = min(batch * head_tiles * splits, launch[3] * sm_count)
        if programs > best_programs:
            best, best_programs = (launch, splits), programs
    return best


def mla_paged_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
    row_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    keys_as_rows: bool = False,
    tma: bool | None = None,
) -> torch.Tensor:
    """q [B, Hq, Dk] attends to the first kv_lens[b] latent rows of request b's pages (keys: the whole row,
    values: its first ``value_dim`` channels) -> [B, Hq, value_dim].

    ``row_scales`` (scale, rope_scale), each [num_pages, page_size(, 1, 1)] fp32: the rows are E4M3 codes
    (``latent`` uint8, ``LATENT_ROW_FORMATS``), row value = code * scale over [0, value_dim) and code *
    rope_scale over the rest. The codes are converted to q's dtype (exactly, for fp16 / bf16) and the scales
    applied to the logits and the probabilities, so the kernel reads one byte a channel.

    ``keys_as_rows``: the products transposed (S^T = K Q^T, O^T = V^T P^T), so the tile of latent rows, not the
    head tile, is the dots' M: 64 rows a warpgroup take Hopper's wgmma, where a tile of 20 heads padded to 32
    takes mma.sync. A launch for ``benchmarks.mla_decode_sweep`` to measure; bf16 / fp16 / fp32 rows only.

    ``tma``: the kernel of ``mla_decode_tma`` (16-bit rows, Dv <= 512): the value channels in two halves, and
    whole tiles of rows read by the tensor memory accelerator where the pool's layout allows it (``tma_layout``:
    BLOCK_N dividing the page size), else gathered; None: ``halves_by_default`` on a GPU of compute capability 9
    or later. Not with ``row_scales`` or ``keys_as_rows``."""
    if keys_as_rows and row_scales is not None:
        raise ValueError("keys_as_rows reads plain latent rows, not E4M3 codes (row_scales)")
    batch, num_heads, dk = q.shape
    if latent.dim() == 4:
        assert latent.shape[2] == 1, f"MLA latent cache has one KV head, got {tuple(latent.shape)}"
        latent = latent[:, :, 0]
    assert latent.dim() == 3 and latent.shape[2] == dk, (q.shape, latent.shape)
    page_size = latent.shape[1]
    dv = int(value_dim)
    assert 0 < dv <= dk, (value_dim, dk)
    if row_scales is None:
        assert latent.dtype == q.dtype, (q.dtype, latent.dtype)
        sv = sr = q  # not read
        stride_sp = stride_ss = 0
    else:
        assert latent.dtype == torch.uint8, latent.dtype
        sv, sr = (t.reshape(latent.shape[0], latent.shape[1]) for t in row_scales)
        assert sv.dtype == sr.dtype == torch.float32 and sv.stride() == sr.stride(), (sv.dtype, sr.dtype)
        stride_sp, stride_ss = sv.stride()
    assert block_tables.shape[0] == batch and kv_lens.shape == (batch,), (block_tables.shape, kv_lens.shape)
    for name, t in (("q", q), ("latent", latent), ("block_tables", block_tables), ("kv_lens", kv_lens)):
        check_last_dim_contiguous(name, t)
    if out is None:
        out = torch.empty((batch, num_heads, dv), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (batch, num_heads, dv) and out.dtype == q.dtype, (out.shape, out.dtype)
        check_last_dim_contiguous("out", out)
    if batch == 0 or num_heads == 0:
        return out
    if block_h is None:  # fp32 tiles of more than 16 heads spill (fp32 dots hold their operands in registers)
        block_h = 16 if q.dtype == torch.float32 else default_block_h(num_heads)
        if row_scales is not None:  # codes converted in registers: 64-head tiles spill, 32 do not (255 registers)
            block_h = min(block_h, 32)
    block_h = max(16, next_pow2(block_h))
    head_tiles = -(-num_heads // block_h)
    block_dv = next_pow2(dv)
    block_dr = max(16, next_pow2(dk - dv))
    max_kv_len = block_tables.shape[1] * page_size
    if tma and (row_scales is not None or keys_as_rows):
        raise ValueError("tma reads plain latent rows with the heads as the dots' rows (no row_scales, keys_as_rows)")
    # the halves kernel's default tile (64 rows) would gather, not read by TMA, on these pages
    gathered = not tma_fits(latent, 64, dv)
    if tma is None:
        tma = (row_scales is None and not keys_as_rows and q.is_cuda
               and torch.cuda.get_device_capability(q.device)[0] >= 9
               and halves_by_default(batch, head_tiles, max_kv_len, num_sms(q.device), block_h, TMA_CHOICE,
                                     gathered))
    tma = bool(tma) and block_dv <= 2 * MAX_BOX and q.dtype != torch.float32
    candidates = _launch_candidates(block_h, block_dv, q.dtype, row_scales is not None, keys_as_rows, tma, gathered)
    overrides = (block_n, num_warps, num_stages)
    if any(overrides):  # a caller's launch: the first candidate's for what it leaves out, and its residency
        first = candidates[0]
        launch = tuple(o or d for o, d in zip(overrides, first[:3]))
        matching = [c for c in candidates if c[:3] == launch]
        candidates = [(*launch, matching[0][3] if matching else first[3])]
    (block_n, num_warps, num_stages, _), splits = choose_launch(candidates, batch, head_tiles, max_kv_len,
                                                                 num_sms(q.device))
    if num_splits is None:
        num_splits = splits
    num_splits, mid_o, mid_lse = split_partials(out, 1, max_kv_len, num_splits)
    upcast, precision = dot_args(_mla_split_kernel, q.dtype)
    on = pdl(q.device)
    # GPUs with less shared memory a block than Hopper's (A100, L40S, sm_120) take fewer stages or rows
    fit_key = ("mla", block_h, num_warps, q.dtype, latent.dtype, dk, dv, bool(keys_as_rows), bool(tma))
    if tma:
        half = max(16, block_dv // 2)

        def launch_halves(rows_a_tile: int, stages: int) -> None:
            rows = tma_layout(latent, rows_a_tile, dv, dk)
            v_desc, r_desc = tma_descriptors(rows, rows_a_tile, half, block_dr) if rows is not None else (None, None)
            _mla_split_tma_kernel[(head_tiles, num_splits, batch)](
                q, latent, v_desc, r_desc, block_tables, kv_lens, out, mid_o, mid_lse,
                scale * _LOG2E, num_heads,
                q.stride(0), q.stride(1),
                latent.stride(0), latent.stride(1),
                block_tables.stride(0),
                out.stride(0), out.stride(1),
                BLOCK_H=block_h, DV=dv, HALF=half, DK=dk, BLOCK_DR=block_dr, HAS_REST=dk > dv,
                PAGE_SIZE=page_size, BLOCK_N=rows_a_tile, NUM_SPLITS=num_splits,
                MIN_SPLIT=max(0, int(min_split_tokens)), UPCAST=upcast, PRECISION=precision, TMA=rows is not None,
                num_warps=num_warps, num_stages=stages, PDL=on, launch_pdl=on,
            )

        launch_fitting(launch_halves, q.device.index, fit_key, block_n, num_stages)
        _combine(mid_o, mid_lse, out, num_splits, dv, block_dv, on)
        return out

    def launch(rows_a_tile: int, stages: int) -> None:
        _mla_split_kernel[(head_tiles, num_splits, batch)](
            q, latent, block_tables, kv_lens, out, mid_o, mid_lse, sv, sr,
            scale * _LOG2E, num_heads,
            q.stride(0), q.stride(1),
            latent.stride(0), latent.stride(1),
            stride_sp, stride_ss,
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            BLOCK_H=block_h, DV=dv, BLOCK_DV=block_dv, DK=dk, BLOCK_DR=block_dr, HAS_REST=dk > dv,
            PAGE_SIZE=page_size, BLOCK_N=rows_a_tile, NUM_SPLITS=num_splits, MIN_SPLIT=max(0, int(min_split_tokens)),
            UPCAST=upcast, PRECISION=precision, CODED=row_scales is not None, KEYS_AS_ROWS=bool(keys_as_rows),
            num_warps=num_warps, num_stages=stages, PDL=on, launch_pdl=on,
        )

    launch_fitting(launch, q.device.index, fit_key, block_n, num_stages)
    _combine(mid_o, mid_lse, out, num_splits, dv, block_dv, on)
    return out


def _combine(mid_o, mid_lse, out, num_splits, dv, block_dv, on_pdl):
    if num_splits > 1:
        _mla_combine_kernel[(out.shape[0], out.shape[1])](
            mid_o, mid_lse, out, out.stride(0), out.stride(1),
            DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)),
            num_warps=4 if block_dv >= 512 else 2, PDL=on_pdl, launch_pdl=on_pdl,
        )
