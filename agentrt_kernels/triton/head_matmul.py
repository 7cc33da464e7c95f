"""Per-head products at a decode step's few rows: each head's rows times that head's own matrix.

``head_matmul(x, w) -> [T, H, N]``
    x:  [T, H, K], last dim contiguous (other strides free), fp32 / fp16 / bf16, T <= MAX_ROWS
    w:  [H, K, N] in x's dtype, any strides (views of a packed weight: an absorbed MLA layer's W_UK
        [H, nope, rank], or W_UV transposed, [H, rank, v])
    returns out [T, H, N] contiguous, out[t, h] = x[t, h] @ w[h], accumulated in fp32 and rounded once to x's
    dtype (as cuBLAS's batched GEMM rounds)

What it replaces: ``torch.bmm`` over the heads at decode sizes, where each head's GEMM has a handful of rows and
the weights (a few MB a layer) are read by few thread blocks. Grid (H, N / BLOCK_N): a program multiplies one
head's rows (padded to a dot tile of 16 rows, or of 32) by a BLOCK_N-column slice of that head's matrix, K in
BLOCK_K chunks; GLM-4.7-Flash's 20 heads give 160 programs for both of its products. Alone it measures the same
as cuBLAS's batched GEMM; on Hopper it is launched under programmatic dependent launch (``_common.pdl``), so in a
decode step it starts as the kernel before it ends, where cuBLAS's kernel waits for a launch gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, dot_args, next_pow2, pdl, pdl_enter

MAX_ROWS = 32  # one dot tile of rows: 16, or 32 past 16 rows
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _head_matmul_kernel(
    x_ptr, w_ptr, out_ptr, rows, K, N,
    stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    h = tl.program_id(0).to(tl.int64)
    tt = tl.arange(0, BLOCK_T)
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    t_mask, n_mask = tt < rows, nn < N
    pdl_enter(PDL)
    dot_ty = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        a = tl.load(x_ptr + tt[:, None] * stride_xt + h * stride_xh + k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + h * stride_wh + k[:, None].to(tl.int64) * stride_wk + nn[None, :] * stride_wn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a.to(dot_ty), b.to(dot_ty), input_precision=PRECISION)
    tl.store(out_ptr + tt[:, None] * stride_ot + h * stride_oh + nn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


def head_matmul(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 64,
                num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """[T, H, K] x [H, K, N] -> [T, H, N]; see the module docstring. The launch knobs are for sweeps."""
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[1] or w.shape[1] != x.shape[2]:
        raise ValueError(f"x [T, H, K] and w [H, K, N] do not match: {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    rows, heads, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")
    check_last_dim_contiguous("x", x)
    n = w.shape[2]
    out = torch.empty((rows, heads, n), dtype=x.dtype, device=x.device)
    if rows == 0 or heads == 0 or n == 0:
        return out
    upcast, precision = dot_args(_head_matmul_kernel, x.dtype)
    on = pdl(x.device)
    _head_matmul_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, out, rows, k, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_T=max(16, next_pow2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PRECISION=precision,
        PDL=on, num_warps=num_warps, num_stages=num_stages, launch_pdl=on,
    )
    return out
