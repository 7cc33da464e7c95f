"""A decode-size linear (a few rows) with the elementwise op before it fused in: one launch in place of two.

``decode_linear(x, weight, bias=None, *, norm=None, residual=None, silu_mul=False, return_normed=False)``
    x:        [M, K] (``silu_mul``: [M, 2K], gate columns first), fp32 / fp16 / bf16, M <= 32
    weight:   [N, K] (torch's ``F.linear`` layout), x's dtype
    bias:     optional [N]
    norm:     optional (norm_weight [K], eps): RMSNorm of x (of x + residual) before the product
    residual: optional, [M, K] like x (only with ``norm``)
    returns   y [M, N] in x's dtype, or (y, x + residual) with ``residual``; ``return_normed`` (with
              ``norm``) adds the normed rows [M, K] (what else reads them: a MoE block's experts after its router)

The operand is what the unfused ops would hand ``F.linear`` up to where 1 / rms is applied: ``silu_and_mul``
exactly (silu in fp32 rounded, times up, rounded); ``rms_norm`` (engine.models.layers.RMSNorm: the sum rounded
to x's dtype, normalised in fp32, rounded, times the weight, rounded) exactly when the normed rows are returned
(two passes over x), else in one pass: the product runs over (x + residual) * weight, rounded,
and its fp32 sums are scaled by 1 / rms at the end (the same function, one rounding in another place). The
product accumulates in fp32; the bias is added to the fp32 sum, rounded once.

Design: decode steps are memory-bound on the weights, so each program streams a BLOCK_N x K slice of the
weight once (BLOCK_K columns at a time) against the few rows of x, which every program reads (from L2:
M x K elements); program 0 writes the new residual (``residual`` is never written in place). With one pass
over x the weight loads start at once: the sum of squares rides along. Launch knobs: ``FMA`` (one row) keeps a
BLOCK_N x BLOCK_K fp32 accumulator of products in registers and reduces it once at the end; otherwise a
``tl.dot`` over rows padded to 16 (to 32 past 16 rows), with ``SWAP`` the weight tile as its left operand
(BLOCK_N is the MMA's M, which Hopper's wgmma wants >= 64) instead of the rows. ``SPLIT_K`` splits each column
tile's reduction over K among that many programs (whole BLOCK_K steps each), for a projection whose few output
columns would otherwise leave most SMs idle (GLM-4.7-Flash's q_a / kv_a: 1344 columns, 21 tiles of 64): each
split stores its fp32 sums (and its part of the norm's sum of squares), and the last of the tile's splits to
arrive (an arrival counter, acquire-release) adds them in split order -- the same bits whichever arrives last --
and finishes the tile as one program would. The counters are zero between launches (that last split resets its
tile's), so a split launch needs no memset launch before it, and one stream's launches share them
(``arrival_counts``).

Which launch: ``tuned_launch`` -- the per-shape winners of ``python -m benchmarks.decode_linear`` on this GPU
(tuned/decode_linear_<GPU name>.json), where the prologue's own kernel plus cuBLAS (``UNFUSED``) may be the
winner; for a shape not measured, ``ONE_ROW_LAUNCH`` for one row and, on a GPU, ``UNFUSED`` for more (on an H200
the fused dot beat cuBLAS only on o_proj at 8 rows; docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentrt_kernels.triton._common import (
    arrival_counts,
    check_last_dim_contiguous,
    dot_args,
    last_to_arrive,
    next_pow2,
    pdl,
    pdl_enter,
)
from agentrt_kernels.triton.activation import silu_and_mul
from agentrt_kernels.triton.fitting_launch import launch_fitting
from agentrt_kernels.triton.norm import rms_norm

MAX_ROWS = 32
ROW_TILE = 16  # rows of the dot's tile up to this many rows, twice that beyond
DEFAULT_LAUNCH = {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "FMA": False, "SWAP": True,
                  "SPLIT_K": 1}
ONE_ROW_LAUNCH = {**DEFAULT_LAUNCH, "BLOCK_N": 8, "BLOCK_K": 1024, "FMA": True}  # the one-row winner on an H200
UNFUSED = {"UNFUSED": True}  # a tuned entry: the prologue's own kernel, then cuBLAS (it measured faster)
# (N, K) -> {rows: launch}: the fastest launches benchmarks.decode_linear measured (load_tuned_launches); a call
# takes the entry for the fewest measured rows >= its rows (else the most), of the rows on its side of 16 (a 16-
# or 32-row tile); other shapes: ``_untuned_launch``.
# On a GPU the table of its name (tuned/decode_linear_<name>.json, the sweep's rows) fills what is not set.
TUNED_LAUNCHES: dict[tuple[int, int], dict[int, dict]] = {}
_TUNED_DIR = Path(__file__).with_name("tuned")
_DEVICES_LOADED: set[torch.device] = set()


def load_tuned_launches(rows: list[dict], replace: bool = True) -> None:
    """Take each row's fastest path (the rows ``python -m benchmarks.decode_linear --json`` writes): its
    ``best_launch``, or ``UNFUSED`` where the prologue's kernel plus cuBLAS was faster. ``replace``: over
    entries already set."""
    for row in rows:
        if row.get("best_s") is not None and row.get("unfused_s") is not None and row["unfused_s"] <= row["best_s"]:
            launch = UNFUSED
        else:
            launch = {k: row["best_launch"][k] for k in DEFAULT_LAUNCH if k in row["best_launch"]}
        by_rows = TUNED_LAUNCHES.setdefault((row["N"], row["K"]), {})
        if replace or row["rows"] not in by_rows:
            by_rows[row["rows"]] = launch


def tuned_table_path(gpu_name: str) -> Path:
    """The tuned launches of the GPU of this name (``torch.cuda.get_device_name``)."""
    return _TUNED_DIR / f"decode_linear_{gpu_name.replace(' ', '_')}.json"


def _load_device_table(device: torch.device) -> None:
    if device.type != "cuda" or device in _DEVICES_LOADED:
        return
    _DEVICES_LOADED.add(device)
    path = tuned_table_path(torch.cuda.get_device_name(device))
    if path.exists():
        load_tuned_launches(json.loads(path.read_text()), replace=False)


def _untuned_launch(rows: int, device: torch.device) -> dict:
    if rows == 1:
        return ONE_ROW_LAUNCH
    return UNFUSED if device.type == "cuda" else DEFAULT_LAUNCH  # the interpreter still runs the kernel


def tuned_launch(n: int, k: int, rows: int, device: torch.device = torch.device("cpu"), itemsize: int = 2) -> dict:
    """The table's entry for a 16-bit x (what the sweep measures: its tiles would not fit fp32's shared memory).
    Rows measured on the call's side of 16 count (a 16- or a 32-row dot tile): one tile's winner says nothing
    of a tile twice its size, nor cuBLAS's time at 8 rows of its time at 32."""
    by_rows = TUNED_LAUNCHES.get((n, k)) if itemsize == 2 else None
    if by_rows:
        by_rows = {r: launch for r, launch in by_rows.items() if (r > ROW_TILE) == (rows > ROW_TILE)}
    if not by_rows:
        return _untuned_launch(rows, device)
    fits = [r for r in by_rows if r >= rows]
    return by_rows[min(fits) if fits else max(by_rows)]


def _unfused(x, weight, bias, norm, residual, silu_mul, return_normed):
    """What ``decode_linear`` computes, as the engine's unfused layers do: the prologue's kernel, then F.linear."""
    if silu_mul:
        return F.linear(silu_and_mul(x), weight, bias)
    if norm is None:
        return F.linear(x, weight, bias)
    if residual is None:
        normed, residual_out = rms_norm(x, norm[0], norm[1]), None
    else:
        normed, residual_out = rms_norm(x, norm[0], norm[1], residual)
    outputs = (F.linear(normed, weight, bias),) + ((residual_out,) if residual is not None else ()) + (
        (normed,) if return_normed else ())
    return outputs if len(outputs) > 1 else outputs[0]


@triton.jit
def _operand(x_ptr, r_ptr, nw_ptr, offs_m, offs_k, m_mask, k_end, K, stride_x, stride_r, rstd,
             NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, ONE_PASS: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of what the linear multiplies, in x's dtype (rows past M and columns from
    ``k_end`` on are 0), and the fp32 (x + residual) tile the sum of squares takes (``ONE_PASS``: the operand is
    not yet scaled by 1 / rms). ``K``: the gate's width, where SiLU-and-mul's up half starts."""
    k_mask = offs_k < k_end
    mask = m_mask[:, None] & k_mask[None, :]
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (act * up).to(x_ptr.dtype.element_ty), gate
    if NORM:
        s = x.to(tl.float32)
        if RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask, other=0.0)
            s = (s + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if ONE_PASS:
            return (s * nw[None, :]).to(x_ptr.dtype.element_ty), s
        h = (s * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (h * nw[None, :]).to(x_ptr.dtype.element_ty), s
    return x, x.to(tl.float32)


@triton.jit
def _decode_linear_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, ro_ptr, no_ptr, part_ptr, sq_part_ptr, count_ptr,
    M, N, K, K_SPLIT, stride_x, stride_r, stride_w, stride_y, stride_ro, stride_no, eps,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)  # SPLIT_K > 1: this program's K_SPLIT columns of the reduction
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # one pass: the sum of squares rides along the weight stream and 1 / rms scales the fp32 sums at the end,
    # so the weight loads start at once (two passes when the normed rows are stored)
    ONE_PASS: tl.constexpr = NORM and not STORE_OPERAND
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_PASS:
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (offs_k < K)[None, :]
            s = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :], mask=mask, other=0.0)
            s = s.to(tl.float32)
            if RESIDUAL:
                r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask, other=0.0)
                s = (s + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
            sq += tl.sum(s * s, 1)
        rstd = tl.rsqrt(sq / K + eps)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # SWAP: W is the dot's left operand (wgmma's M)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # FMA: products summed over K tiles, reduced once
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0)
        a, s = _operand(x_ptr, r_ptr, nw_ptr, offs_m, offs_k, m_mask, k_hi, K, stride_x, stride_r, rstd,
                        NORM, RESIDUAL, SILU_MUL, ONE_PASS)
        if ONE_PASS:
            sq += tl.sum(s * s, 1)
        if RESIDUAL:
            if pid == 0:
                tl.store(ro_ptr + offs_m[:, None].to(tl.int64) * stride_ro + offs_k[None, :],
                         s.to(x_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_k < k_hi)[None, :])
        if STORE_OPERAND:
            if pid == 0:
                tl.store(no_ptr + offs_m[:, None].to(tl.int64) * stride_no + offs_k[None, :], a,
                         mask=m_mask[:, None] & (offs_k < k_hi)[None, :])
        if FMA:  # one row: multiply-adds in registers, the weight tile never staged for a dot
            acc2 += a.to(tl.float32) * w.to(tl.float32)
        elif UPCAST:  # the interpreter's bf16 dot is wrong: multiply the (exact) fp32 copies
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif SWAP:
            acc_t += tl.dot(w, tl.trans(a), input_precision=PRECISION)
        else:
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if FMA:
        acc += tl.sum(acc2, 1)[None, :]
    if SWAP and not UPCAST and not FMA:
        acc += tl.trans(acc_t)
    if SPLIT_K > 1:
        # each split stores its fp32 sums (and sum of squares); the column tile's last split to arrive adds them
        # up in split order (the same result whichever arrives last) and finishes as one program would
        part = (pid * SPLIT_K + split) * BLOCK_M
        tl.store(part_ptr + (part + offs_m)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc)
        tl.store(sq_part_ptr + part + offs_m, sq)
        if not last_to_arrive(count_ptr + pid, SPLIT_K):
            return
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in range(SPLIT_K):
            part = (pid * SPLIT_K + s) * BLOCK_M
            acc += tl.load(part_ptr + (part + offs_m)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
                           cache_modifier=".cg")
            sq += tl.load(sq_part_ptr + part + offs_m, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0)  # ready for the next launch, which waits for this one to finish
    if ONE_PASS:
        acc = acc * tl.rsqrt(sq / K + eps)[:, None]
    if HAS_BIAS:  # added to the fp32 sum, rounded once with it (F.linear's addmm epilogue)
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


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
    multiply-adds in registers instead of a ``tl.dot`` over rows padded to 16 or 32), SWAP, SPLIT_K (programs a column
    tile's reduction is split among; fewer where K has fewer BLOCK_K steps); or ``UNFUSED`` (default:
    ``tuned_launch``)."""
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
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
        check_last_dim_contiguous("residual", residual)
    if norm is not None and norm[0].shape != (k,):
        raise ValueError(f"norm weight {tuple(norm[0].shape)} does not match K = {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match N = {n}")
    if launch is None:
        _load_device_table(x.device)
        launch = tuned_launch(n, k, rows, x.device, x.element_size())
    if launch.get("UNFUSED") and rows > 0:
        return _unfused(x, weight, bias, norm, residual, silu_mul, return_normed)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    normed = torch.empty((rows, k), dtype=x.dtype, device=x.device) if return_normed else None
    outputs = (y,) + ((residual_out,) if residual is not None else ()) + ((normed,) if return_normed else ())
    result = outputs if len(outputs) > 1 else y
    if rows == 0:
        return result
    cfg = {**DEFAULT_LAUNCH, **launch}
    fma = bool(cfg["FMA"]) and rows == 1
    block_m, block_n, block_k = 1 if fma else max(ROW_TILE, next_pow2(rows)), cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = triton.cdiv(n, block_n)
    # splits of whole BLOCK_K steps, none empty
    k_split = triton.cdiv(triton.cdiv(k, max(1, int(cfg["SPLIT_K"]))), block_k) * block_k
    split_k = triton.cdiv(k, k_split)
    if split_k > 1:
        parts = torch.empty((tiles * split_k * block_m, block_n), dtype=torch.float32, device=x.device)
        sq_parts = torch.empty((tiles * split_k * block_m,), dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device, tiles)
    else:
        parts = sq_parts = counts = y
    upcast, precision = dot_args(_decode_linear_kernel, x.dtype)
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else x
    nw = norm[0] if norm is not None else x
    no = normed if normed is not None else x
    on = pdl(x.device)

    def launch(depth_a_tile: int, stages: int) -> None:
        _decode_linear_kernel[(tiles, split_k)](
            x, r, nw, weight, bias if bias is not None else weight, y, ro, no, parts, sq_parts, counts,
            rows, n, k, k_split, x.stride(0), r.stride(0), weight.stride(0), y.stride(0), ro.stride(0), no.stride(0),
            norm[1] if norm is not None else 0.0,
            NORM=norm is not None, RESIDUAL=residual is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
            STORE_OPERAND=return_normed,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=depth_a_tile, UPCAST=upcast,
            PRECISION=precision, FMA=fma, SWAP=bool(cfg["SWAP"]), SPLIT_K=split_k,
            num_warps=cfg["num_warps"], num_stages=stages, PDL=on, launch_pdl=on,
        )

    # GPUs with less shared memory a block than Hopper's take fewer stages or shallower K tiles (a split's range
    # is whole BLOCK_K steps, so whole steps of half the depth too)
    launch_fitting(launch, x.device.index, ("decode_linear", block_m, block_n, cfg["num_warps"], x.dtype), block_k,
                   cfg["num_stages"])
    return result
