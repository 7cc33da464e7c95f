"""A decode-size linear (a few rows) with the elementwise op before it fused in: one launch in place of two.

``decode_linear(x, weight, bias=None, *, norm=None, residual=None, silu_mul=False, return_normed=False)``
    x:        [M, K] (``silu_mul``: [M, 2K], gate columns first), fp32 / fp16 / bf16, M <= 16
    weight:   [N, K] (torch's ``F.linear`` layout), x's dtype
    bias:     optional [N]
    norm:     optional (norm_weight [K], eps): RMSNorm of x (of x + residual) before the product
    residual: optional, [M, K] like x (only with ``norm``)
    returns   y [M, N] in x's dtype, or (y, x + residual) with ``residual``; ``return_normed`` (with
              ``norm``) adds the normed rows [M, K] (what else reads them: a MoE block's experts after its router)

The operand each output column reads is what the unfused ops would hand ``F.linear``, rounded where they
round: ``rms_norm`` (engine.models.layers.RMSNorm: the sum rounded to x's dtype, normalised in fp32, rounded,
times the weight, rounded) or ``silu_and_mul`` (silu in fp32 rounded, times up, rounded). The product
accumulates in fp32 (``tl.dot`` over rows padded to 16, or for one row multiply-adds in registers: launch
``FMA``), the bias is added to the fp32 sum, rounded once.

Design: decode steps are memory-bound on the weights, so each program streams a BLOCK_N x (K / SPLIT_K) slice
of the weight once (BLOCK_K columns at a time, pipelined) against the few rows of x, which every program reads
(from L2: M x K elements). With ``norm`` a first pass over x gives each row's 1 / rms (and, from program 0
only, the new residual; so ``residual`` is never written in place). ``SPLIT_K`` > 1 splits K over programs
for more bytes in flight (a short N: Llama-3.1-8B's o_proj and down have 4096 rows): each writes its fp32 sum to
a scratch row and counts itself in on a per-block counter; the last to arrive adds the partial sums in split
order (so the result does not depend on who came last), writes y and resets the counter, all in one launch.
``FMA`` (one row) keeps a BLOCK_N x BLOCK_K fp32 accumulator of products in registers and reduces it once at
the end, in place of a ``tl.dot`` over 16 padded rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args

MAX_ROWS = 16
DEFAULT_LAUNCH = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "FMA": False, "SPLIT_K": 1}
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # SPLIT_K > 1: per-block arrival counts, zero between launches
_MAX_BLOCKS = 1 << 16
# (N, K) -> {rows: launch}: the fastest launches benchmarks.decode_linear measured (load_tuned_launches); a call
# takes the entry for the fewest measured rows >= its rows (else the most), and DEFAULT_LAUNCH for other shapes
TUNED_LAUNCHES: dict[tuple[int, int], dict[int, dict]] = {}


def load_tuned_launches(rows: list[dict]) -> None:
    """Take each row's ``best_launch`` (the rows ``python -m benchmarks.decode_linear --json`` writes)."""
    for row in rows:
        launch = {k: row["best_launch"][k] for k in DEFAULT_LAUNCH if k in row["best_launch"]}
        TUNED_LAUNCHES.setdefault((row["N"], row["K"]), {})[row["rows"]] = launch


def tuned_launch(n: int, k: int, rows: int) -> dict:
    by_rows = TUNED_LAUNCHES.get((n, k))
    if not by_rows:
        return DEFAULT_LAUNCH
    fits = [r for r in by_rows if r >= rows]
    return by_rows[min(fits) if fits else max(by_rows)]


@triton.jit
def _operand(x_ptr, r_ptr, nw_ptr, offs_m, offs_k, m_mask, K, stride_x, stride_r, rstd,
             NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of what the linear multiplies, in x's dtype (rows past M are 0)."""
    k_mask = offs_k < K
    mask = m_mask[:, None] & k_mask[None, :]
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (act * up).to(x_ptr.dtype.element_ty)
    if NORM:
        s = x.to(tl.float32)
        if RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask, other=0.0)
            s = (s + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        h = (s * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        return (h * nw[None, :]).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _decode_linear_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ro_ptr, no_ptr, part_ptr, count_ptr,
    M, N, K, K_PER_SPLIT, stride_x, stride_r, stride_w, stride_y, stride_ro, stride_no, eps,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, FMA: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (offs_k < K)[None, :]
            s = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :], mask=mask, other=0.0)
            s = s.to(tl.float32)
            if RESIDUAL:
                r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask, other=0.0)
                s_x = (s + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
                if pid == 0 and pid_k == 0:
                    tl.store(ro_ptr + offs_m[:, None].to(tl.int64) * stride_ro + offs_k[None, :], s_x, mask=mask)
                s = s_x.to(tl.float32)
            sq += tl.sum(s * s, 1)
        rstd = tl.rsqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # FMA: products summed over K tiles, reduced once
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _operand(x_ptr, r_ptr, nw_ptr, offs_m, offs_k, m_mask, K, stride_x, stride_r, rstd,
                     NORM, RESIDUAL, SILU_MUL)
        if STORE_OPERAND:
            if pid == 0:
                tl.store(no_ptr + offs_m[:, None].to(tl.int64) * stride_no + offs_k[None, :], a,
                         mask=m_mask[:, None] & (offs_k < K)[None, :])
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if FMA:  # one row: multiply-adds in registers, the weight tile never staged for a dot
            acc2 += a.to(tl.float32) * w.to(tl.float32)
        elif UPCAST:  # the interpreter's bf16 dot is wrong: multiply the (exact) fp32 copies
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if FMA:
        acc += tl.sum(acc2, 1)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:  # added to the fp32 sum, rounded once with it (F.linear's addmm epilogue)
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part + pid_k.to(tl.int64) * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the block's splits: sum them in split order
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid, 0)


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    if blocks > _MAX_BLOCKS:
        raise ValueError(f"decode_linear with SPLIT_K > 1 takes at most {_MAX_BLOCKS} column blocks, got {blocks}")
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_MAX_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    return_normed: bool = False,
    launch: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """See the module docstring. ``launch``: BLOCK_N / BLOCK_K / num_warps / num_stages, FMA (one row:
    multiply-adds in registers instead of a ``tl.dot`` over 16 padded rows) and SPLIT_K (default: ``tuned_launch``)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if rows > MAX_ROWS:
        raise ValueError(f"decode_linear takes at most {MAX_ROWS} rows, got {rows}")
    if norm is not None and silu_mul:
        raise ValueError("norm and silu_mul are exclusive")
    if (residual is not None or return_normed) and norm is None:
        raise ValueError("residual and return_normed need norm")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (silu_mul={silu_mul})")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
        check_last_dim_contiguous("residual", residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"norm weight {tuple(norm[0].shape)} does not match K = {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match N = {n}")
    normed = torch.empty((rows, k), dtype=x.dtype, device=x.device) if return_normed else None
    outputs = (y,) + ((residual_out,) if residual is not None else ()) + ((normed,) if return_normed else ())
    result = outputs if len(outputs) > 1 else y
    if rows == 0:
        return result
    cfg = {**DEFAULT_LAUNCH, **(launch if launch is not None else tuned_launch(n, k, rows))}
    fma = bool(cfg["FMA"]) and rows == 1
    split = max(1, min(int(cfg["SPLIT_K"]), triton.cdiv(k, cfg["BLOCK_K"])))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)  # no empty split
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else y
    counts = _counters(x.device, blocks) if split > 1 else y
    upcast, precision = dot_args(_decode_linear_kernel, x.dtype)
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else x
    nw = norm[0] if norm is not None else x
    no = normed if normed is not None else x
    _decode_linear_kernel[(blocks, split)](
        x, r, nw, weight, bias if bias is not None else weight, y, ro, no, part, counts,
        rows, n, k, k_per_split, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), ro.stride(0),
        no.stride(0), norm[1] if norm is not None else 0.0,
        NORM=norm is not None, RESIDUAL=residual is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
        STORE_OPERAND=return_normed,
        BLOCK_M=1 if fma else MAX_ROWS, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], UPCAST=upcast,
        PRECISION=precision, FMA=fma, SPLIT_K=split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return result
