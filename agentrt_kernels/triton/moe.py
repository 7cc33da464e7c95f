"""Fused MoE for top-k routed SwiGLU experts: token sorting + two grouped GEMMs.

``fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, H]``
    x:            [T, H] fp32 / fp16 / bf16
    w_gate_up:    [E, 2I, H] (rows [0, I) gate, [I, 2I) up, as engine.models.moe.StackedExperts)
    w_down:       [E, H, I]
    topk_weights: [T, k] (any float dtype; used in x's dtype like the torch block)
    topk_ids:     [T, k] integer expert ids in [0, E)
    returns       sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]

``moe_align_block_size(topk_ids, num_experts, block_m) -> (sorted_ids, expert_ids)``
    The T*k (token, choice) slots grouped by expert, each expert's run padded to a multiple of block_m
    with the sentinel T*k: sorted_ids [max_blocks * block_m] int32, expert_ids [max_blocks] int32 (== E
    for blocks past the last expert's run). Histogram + prefix sum + layout in one program, then an atomic
    scatter, in that same program for at most 1024 slots (one launch) or a second kernel for more, instead of a
    dozen torch ops. max_blocks = cdiv(T*k + E*(block_m-1), block_m) is a bound known
    from shapes alone, so nothing syncs with the host and the whole op is CUDA-graph capturable.

Kernel 1 (gate_up): grid over (block of BLOCK_M sorted slots, BLOCK_N columns of I). Each block belongs
to one expert, gathers its tokens' x rows, multiplies by that expert's gate and up rows (two accumulators
sharing the A tile) and applies silu(gate) * up in the epilogue, writing [T*k, I] (rows in slot order).
Kernel 2 (down): the same grouped GEMM over the intermediate with w_down, scaled by the routing weight in
the epilogue, writing [T*k, H]; a third launch sums a token's k choices in fp32, rounded once -- or, with
``SUM_IN_DOWN`` (a decode step's few tokens), the down GEMM's own launch does: every program arrives on its
column block's counter (blocks without an expert too), and the last to arrive adds the tokens' choices for that
block in slot order (the same bits as the separate launch; ``decode_linear``'s split launches use the same
arrival counters, ``_common.arrival_counts``).
Intermediates are rounded to x's dtype where the torch reference rounds (gate/up products, silu, down
product, weight product).
Blocks past the padded total exit at once. A GROUP_M swizzle keeps consecutive programs on the same
expert's weight tiles for L2 reuse.
"""

from __future__ import annotations

import json
import os

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
    pdl,
    pdl_enter,
)


@triton.jit
def _moe_align_count_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, cursor_ptr,
    num_slots, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, SCATTER: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program: expert histogram, padded offsets, per-block expert ids, sentinel fill; with SCATTER (at most
    CHUNK slots: a decode step's) the slots' placement too, after a barrier, so the op is one launch."""
    pdl_enter(PDL)
    offs_e = tl.arange(0, E_PAD)
    valid_e = offs_e < num_experts
    counts = tl.full([E_PAD], 0, dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=E_PAD - 1).to(tl.int32)
        counts += tl.histogram(e, E_PAD)
    padded = tl.where(valid_e, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pad_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + offs_e, pad_end - padded, mask=valid_e)
    for b0 in range(0, max_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        ended = (pad_end[None, :] <= (blk * BLOCK_M)[:, None]) & valid_e[None, :]
        tl.store(expert_ids_ptr + blk, tl.sum(ended.to(tl.int32), 1), mask=blk < max_blocks)
    for s0 in range(0, max_padded, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.full([CHUNK], 0, dtype=tl.int32) + num_slots, mask=offs < max_padded)
    if SCATTER:  # the cursors and the fill above, visible to every thread of this program
        tl.debug_barrier()
        _place_slots(ids_ptr, sorted_ptr, cursor_ptr, tl.arange(0, CHUNK), num_slots)


@triton.jit
def _place_slots(ids_ptr, sorted_ptr, cursor_ptr, offs, num_slots):
    """Each slot in ``offs`` takes the next position of its expert's run (atomic cursor)."""
    mask = offs < num_slots
    e = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    pos = tl.atomic_add(cursor_ptr + e, tl.full(offs.shape, 1, dtype=tl.int32), mask=mask)
    tl.store(sorted_ptr + pos, offs, mask=mask)


@triton.jit
def _moe_align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, num_slots, CHUNK: tl.constexpr,
                              PDL: tl.constexpr = False):
    """More slots than one program places: CHUNK slots a program."""
    pdl_enter(PDL)
    _place_slots(ids_ptr, sorted_ptr, cursor_ptr, tl.program_id(0) * CHUNK + tl.arange(0, CHUNK), num_slots)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_blocks * block_m] int32, expert_ids [max_blocks] int32); see the module docstring.

    One program counts and lays out the runs and, for at most 1024 slots, places each slot (one launch); more
    slots are placed by a parallel scatter (a second launch).
    Slots of one expert land in arbitrary order within its run (atomics); the GEMMs treat rows
    independently, so results do not depend on that order.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_slots = flat.numel()
    max_padded = num_slots + num_experts * (block_m - 1)
    max_blocks = cdiv(max_padded, block_m)
    sorted_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=device)
    e_pad = next_pow2(num_experts + 1)
    chunk = 1024
    one_program = num_slots <= chunk
    _moe_align_count_kernel[(1,)](
        flat, sorted_ids, expert_ids, cursor, num_slots, num_experts, max_blocks * block_m, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, BLOCK_B=max(16, min(128, 8192 // e_pad)), SCATTER=one_program,
        num_warps=8, PDL=(on := pdl(device)), launch_pdl=on,
    )
    if not one_program:
        _moe_align_scatter_kernel[(triton.cdiv(num_slots, chunk),)](flat, sorted_ids, cursor, num_slots,
                                                                    CHUNK=chunk, num_warps=4, PDL=on, launch_pdl=on)
    return sorted_ids, expert_ids


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, w_ptr, out_ptr, count_ptr,
    N, K, num_slots, num_experts, num_tokens,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SUM_TOPK: tl.constexpr = False, BLOCK_T: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_pid_m = tl.num_programs(0) // num_pid_n
    pids_in_group = GROUP_M * num_pid_n
    group = pid // pids_in_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_in_group) % group_size
    pid_n = (pid % pids_in_group) // group_size

    expert = tl.load(expert_ids_ptr + pid_m)
    if SUM_TOPK:  # every block of slots arrives, its expert's or none; the column block's last adds the choices
        if expert < num_experts:
            _expert_block(a_ptr, b_ptr, c_ptr, sorted_ids_ptr, w_ptr, expert, pid_m, pid_n, N, K, num_slots,
                          stride_am, stride_be, stride_bn, stride_cm, TOP_K, A_BY_TOKEN, GATED, MUL_WEIGHT,
                          BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        if last_to_arrive(count_ptr + pid_n, num_pid_m):
            _sum_choices(c_ptr, out_ptr, pid_n, N, num_tokens, stride_cm, TOP_K, BLOCK_T, BLOCK_N)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch, which waits for this one to finish
    else:
        if expert >= num_experts:
            return
        _expert_block(a_ptr, b_ptr, c_ptr, sorted_ids_ptr, w_ptr, expert, pid_m, pid_n, N, K, num_slots,
                      stride_am, stride_be, stride_bn, stride_cm, TOP_K, A_BY_TOKEN, GATED, MUL_WEIGHT,
                      BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)


@triton.jit
def _expert_block(a_ptr, b_ptr, c_ptr, sorted_ids_ptr, w_ptr, expert, pid_m, pid_n, N, K, num_slots,
                  stride_am, stride_be, stride_bn, stride_cm,
                  TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BLOCK_M slots of one expert times BLOCK_N columns of its weights, stored in slot order."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids_ptr + offs_m)
    row_mask = slots < num_slots
    if A_BY_TOKEN:
        a_rows = slots // TOP_K
    else:
        a_rows = slots
    a_rows = tl.where(row_mask, a_rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    dot_ty = tl.float32 if UPCAST else b_ptr.dtype.element_ty
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(dot_ty)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(dot_ty)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if GATED:
            bu = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(dot_ty)
            acc_up += tl.dot(a, bu, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out_ty = c_ptr.dtype.element_ty
    res = acc.to(out_ty).to(tl.float32)
    if GATED:
        up = acc_up.to(out_ty).to(tl.float32)
        act = (res / (1.0 + tl.exp(-res))).to(out_ty).to(tl.float32)
        res = act * up
    if MUL_WEIGHT:
        w = tl.load(w_ptr + tl.where(row_mask, slots, 0), mask=row_mask, other=0.0).to(tl.float32)
        res = res * w[:, None]
    c_ptrs = c_ptr + tl.where(row_mask, slots, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, res.to(out_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_choices(c_ptr, out_ptr, pid_n, N, num_tokens, stride_cm,
                 TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, cols] = the TOP_K slot rows t * TOP_K + j summed in fp32 in slot order, rounded once: what
    ``_topk_sum_kernel`` computes, for one column block, from rows other programs stored (read from L2)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_t < num_tokens)[:, None] & (offs_n < N)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        rows = (offs_t.to(tl.int64) * TOP_K + j) * stride_cm
        acc += tl.load(c_ptr + rows[:, None] + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(
            tl.float32)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _topk_sum_kernel(src_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum over the TOP_K rows src[t * TOP_K + j], in fp32 in slot order, rounded once (torch's sum
    over a bf16 / fp16 dim accumulates in fp32 too)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (t * TOP_K + j) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


TOPK_SUM_BLOCK = 1024  # columns a program of the top-k sum takes
# The top-k sum inside the down GEMM's launch (the last program of each column block adds the tokens' choices)
# for at most this many tokens; AGENTRT_MOE_SUM_IN_DOWN=1 turns it on (off by default: a decode step measured no
# shorter with it, docs/benchmarks.md), a ``config`` key of the same name per call
SUM_IN_DOWN = os.environ.get("AGENTRT_MOE_SUM_IN_DOWN", "0") == "1"
SUM_IN_DOWN_MAX_TOKENS = 64


def topk_sum(down_out: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T * k, H] contiguous rows in slot order -> [T, H]: each token's k rows summed, one program per token and
    column block (torch's sum over the k dim launches its general reduction kernel)."""
    hidden = down_out.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=down_out.dtype, device=down_out.device)
    _topk_sum_kernel[(num_tokens, triton.cdiv(hidden, TOPK_SUM_BLOCK))](
        down_out, out, hidden, TOP_K=top_k, BLOCK=TOPK_SUM_BLOCK, num_warps=4, PDL=(on := pdl(out.device)),
        launch_pdl=on)
    return out


DECODE_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "BLOCK_N_DOWN")


def decode_config_override(text: str | None) -> dict[str, int]:
    """``AGENTRT_MOE_DECODE_CONFIG``'s JSON object: launch keys (``DECODE_CONFIG_KEYS``, positive integers) over
    the decode-size default -- to time a launch in the engine that ``benchmarks.moe_kernels`` found faster."""
    if not text:
        return {}
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"AGENTRT_MOE_DECODE_CONFIG is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("AGENTRT_MOE_DECODE_CONFIG must be a JSON object of launch keys")
    for key, value in cfg.items():
        if key not in DECODE_CONFIG_KEYS:
            raise ValueError(f"AGENTRT_MOE_DECODE_CONFIG: unknown key {key!r} (one of {', '.join(DECODE_CONFIG_KEYS)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"AGENTRT_MOE_DECODE_CONFIG: {key} must be a positive integer, not {value!r}")
    return cfg


DECODE_CONFIG = decode_config_override(os.environ.get("AGENTRT_MOE_DECODE_CONFIG"))


def _default_config(num_slots: int, num_experts: int) -> dict[str, int]:
    """Block shapes by tokens per expert (chosen on an H200, bf16, E=128 k=8 H=2048 I=768). Decode (one
    16-row block per expert): narrow, deep tiles, the fastest of ``python -m benchmarks.moe_kernels``' grid at
    T = 8 and 32 (closer to the copy rate than 64 x 64 tiles; figures in docs/benchmarks.md), or
    ``AGENTRT_MOE_DECODE_CONFIG``'s keys over them."""
    per_expert = max(1, num_slots // max(1, num_experts))
    block_m = min(128, max(16, next_pow2(per_expert)))
    if block_m == 16:
        return {**dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3), **DECODE_CONFIG}
    block_n = 128 if block_m >= 64 else 64
    num_warps = 8 if block_m * block_n >= 8192 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, num_warps=num_warps, num_stages=3)


def _gemm(a, b, c, sorted_ids, expert_ids, weights, n, k, num_slots, num_experts, top_k,
          a_by_token, gated, mul_weight, cfg, summed=None):
    """``summed``: [T, n], written with each token's top_k rows of ``c`` added (by the last program of each
    column block to arrive) -- the top-k sum inside this launch."""
    upcast, precision = dot_args(_moe_gemm_kernel, b.dtype)
    num_blocks_m = expert_ids.shape[0]
    n_blocks = triton.cdiv(n, cfg["BLOCK_N"])
    num_tokens = num_slots // top_k
    counts = arrival_counts(c.device, n_blocks) if summed is not None else c
    _moe_gemm_kernel[(num_blocks_m * n_blocks,)](
        a, b, c, sorted_ids, expert_ids, weights, summed if summed is not None else c, counts,
        n, k, num_slots, num_experts, num_tokens,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, A_BY_TOKEN=a_by_token, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        UPCAST=upcast, PRECISION=precision, SUM_TOPK=summed is not None, BLOCK_T=max(2, next_pow2(num_tokens)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PDL=(on := pdl(c.device)), launch_pdl=on,
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Top-k routed SwiGLU experts over x [T, H] -> [T, H] in x's dtype (see the module docstring)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, h2 = w_gate_up.shape
    inter = two_i // 2
    assert h2 == hidden and two_i == 2 * inter and w_down.shape == (num_experts, hidden, inter), (
        x.shape, w_gate_up.shape, w_down.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (topk_ids.shape, x.shape)
    assert x.dtype == w_gate_up.dtype == w_down.dtype, (x.dtype, w_gate_up.dtype, w_down.dtype)
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_last_dim_contiguous(name, t)
    cfg = dict(_default_config(num_slots, num_experts), **(config or {}))
    sum_in_down = cfg.pop("SUM_IN_DOWN", SUM_IN_DOWN) and 1 < top_k and num_tokens <= SUM_IN_DOWN_MAX_TOKENS
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, cfg["BLOCK_M"])
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()

    inter_out = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _gemm(x, w_gate_up, inter_out, sorted_ids, expert_ids, weights, inter, hidden, num_slots, num_experts,
          top_k, a_by_token=True, gated=True, mul_weight=False, cfg=cfg)
    down_cfg = dict(cfg, BLOCK_N=cfg.get("BLOCK_N_DOWN", cfg["BLOCK_N"]))
    down_out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    summed = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device) if sum_in_down else None
    _gemm(inter_out, w_down, down_out, sorted_ids, expert_ids, weights, hidden, inter, num_slots, num_experts,
          top_k, a_by_token=False, gated=False, mul_weight=True, cfg=down_cfg, summed=summed)
    if summed is not None:
        return summed
    if top_k == 1:
        return down_out.view(num_tokens, hidden)
    return topk_sum(down_out, num_tokens, top_k)
