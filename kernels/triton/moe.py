"""Fused MoE for top-k routed SwiGLU experts: token sorting + two grouped GEMMs.

``fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids) -> [T, H]``
    x:            [T, H] fp32 / fp16 / bf16
    w_gate_up:    [E, 2I, H] (rows [0, I) gate, [I, 2I) up, as engine.models.moe.StackedExperts)
    w_down:       [E, H, I]
    topk_weights: [T, k] (any float dtype; used in x's dtype like the torch block)
    topk_ids:     [T, k] integer expert ids in [0, E)
    returns       sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]

``moe_align_block_size(topk_ids, num_experts, block_m) -> (sorted_ids, expert_ids)``
    The T*k (token, choice) slots sorted by expert, each expert's run padded to a multiple of block_m with
    the sentinel T*k: sorted_ids [max_blocks * block_m] int64, expert_ids [max_blocks] int64 (== E for
    blocks past the last expert's run). max_blocks = cdiv(T*k + E*(block_m-1), block_m) is a bound known
    from shapes alone, so nothing syncs with the host and the whole op is CUDA-graph capturable.

Kernel 1 (gate_up): grid over (block of BLOCK_M sorted slots, BLOCK_N columns of I). Each block belongs
to one expert, gathers its tokens' x rows, multiplies by that expert's gate and up rows (two accumulators
sharing the A tile) and applies silu(gate) * up in the epilogue, writing [T*k, I] (rows in slot order).
Kernel 2 (down): the same grouped GEMM over the intermediate with w_down, scaled by the routing weight in
the epilogue, writing [T*k, H]; the k choices of a token are then summed. Intermediates are rounded to
x's dtype where the torch reference rounds (gate/up products, silu, down product, weight product).
Blocks past the padded total exit at once. A GROUP_M swizzle keeps consecutive programs on the same
expert's weight tiles for L2 reuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import cdiv, check_last_dim_contiguous, dot_args, next_pow2


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    max_blocks = cdiv(num_slots + num_experts * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = pad_start[expert_of] + torch.arange(num_slots, device=device) - cnt_start[expert_of]
    sorted_ids = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_starts = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(pad_end, block_starts, right=True)
    return sorted_ids, expert_ids


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, w_ptr,
    N, K, num_slots, num_experts,
    stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    pids_in_group = GROUP_M * num_pid_n
    group = pid // pids_in_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_in_group) % group_size
    pid_n = (pid % pids_in_group) // group_size

    expert = tl.load(expert_ids_ptr + pid_m)
    if expert >= num_experts:
        return
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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


def _default_config(num_slots: int, num_experts: int, gated: bool) -> dict[str, int]:
    per_expert = max(1, num_slots // max(1, num_experts))
    block_m = min(64, max(16, next_pow2(per_expert)))
    block_n = 64 if gated else 128
    if block_m <= 16:
        block_n = 64
    num_warps = 8 if block_m * block_n >= 8192 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, num_warps=num_warps, num_stages=3)


def _gemm(a, b, c, sorted_ids, expert_ids, weights, n, k, num_slots, num_experts, top_k,
          a_by_token, gated, mul_weight, cfg):
    upcast, precision = dot_args(_moe_gemm_kernel, b.dtype)
    num_blocks_m = expert_ids.shape[0]
    grid = (num_blocks_m * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, b, c, sorted_ids, expert_ids, weights,
        n, k, num_slots, num_experts,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, A_BY_TOKEN=a_by_token, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        UPCAST=upcast, PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
    cfg = dict(_default_config(num_slots, num_experts, gated=True), **(config or {}))
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, cfg["BLOCK_M"])
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()

    inter_out = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _gemm(x, w_gate_up, inter_out, sorted_ids, expert_ids, weights, inter, hidden, num_slots, num_experts,
          top_k, a_by_token=True, gated=True, mul_weight=False, cfg=cfg)
    down_cfg = dict(cfg, BLOCK_N=cfg.get("BLOCK_N_DOWN", 128 if cfg["BLOCK_M"] > 16 else 64))
    down_out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _gemm(inter_out, w_down, down_out, sorted_ids, expert_ids, weights, hidden, inter, num_slots, num_experts,
          top_k, a_by_token=False, gated=False, mul_weight=True, cfg=down_cfg)
    if top_k == 1:
        return down_out.view(num_tokens, hidden)
    return down_out.view(num_tokens, top_k, hidden).sum(dim=1)
