"""The gated RMSNorm of the DeltaNet's output (Qwen3-Next / Qwen3.5), one kernel instead of a chain of torch ops.

``gated_rms_norm(x [..., D], gate [..., D], weight [D], eps)`` -> [..., D] in x's dtype, matching
``agentrt_kernels.torch_ref.norm.gated_rms_norm``: per row h = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's
dtype; times weight, rounded to promote(weight, x) as torch's multiply; times SiLU(gate) in fp32, rounded to x's
dtype. x and gate may be strided [T, heads, D] views (last dim contiguous). A program normalises BLOCK_R rows of
BLOCK_D = next_pow2(D) columns; all math in fp32 (the interpreter runs bf16 correctly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import next_pow2


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, o_ptr, n_rows, heads, stride_xt, stride_xh, stride_gt, stride_gh,
                           eps, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = rows < n_rows, cols < D
    mask = rmask[:, None] & cmask[None, :]
    t, h = rows // heads, rows % heads
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + (t * stride_gt + h * stride_gh)[:, None] + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    scaled = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(o_ptr.dtype.element_ty)
    gf = g.to(tl.float32)
    out = scaled.to(tl.float32) * (gf / (1.0 + tl.exp(-gf)))
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [T, heads, D] (or [T, D]; last dim contiguous) -> out [T, heads, D] contiguous, x's dtype."""
    assert x.shape == gate.shape and x.shape[-1] == weight.shape[0] and x.stride(-1) == gate.stride(-1) == 1
    x3, g3 = (x if x.dim() == 3 else x[:, None]), (gate if gate.dim() == 3 else gate[:, None])
    tokens, heads, d = x3.shape
    # the product with weight rounds to promote(weight, x), as torch's; the gate product back to x's dtype
    assert torch.promote_types(weight.dtype, x.dtype) == x.dtype, (weight.dtype, x.dtype)
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    n_rows = tokens * heads
    if n_rows == 0:
        return out.view(x.shape)
    block_d = next_pow2(d)
    block_r = max(1, min(16, 4096 // block_d))
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, g3, weight, out, n_rows, heads, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), eps,
        D=d, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4)
    return out.view(x.shape)
