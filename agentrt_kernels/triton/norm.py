"""RMSNorm, optionally fused with the residual add, matching agentrt_kernels.torch_ref.norm (HF Llama).

``rms_norm(x, weight, eps, residual=None, *, out=None, residual_out=None)``
    x:        [..., H] fp32 / fp16 / bf16 (last dim contiguous; e.g. [T, H], or a strided [T, heads, D]
              view for q/k-norm)
    weight:   [H]
    residual: optional, same shape/dtype as x
    returns   out, or (out, new_residual) with residual

Math, per row: s = x (or x + residual, rounded to x.dtype exactly like the torch add, and returned as the
new residual); h = s * rsqrt(mean(s^2) + eps) in fp32; out = weight * h.to(x.dtype), the product taken in
fp32 and rounded once to promote(weight.dtype, x.dtype), which is what torch's mixed/low-precision
multiply does. ``zero_centered`` (Qwen3-Next's norm): out = (h * (1 + weight)) in fp32, rounded once to
x.dtype. One read of x (and residual), one write of out (and residual). A program normalises BLOCK_R rows
of BLOCK_H = next_pow2(H) columns (several short rows per program for head-dim norms).
``residual_out=residual`` updates the residual in place (each row is read before it is written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr,
    n_rows, n_inner, stride_x0, stride_x1, stride_r0, stride_r1, stride_o, stride_ro,
    eps,
    H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)
    i0 = rows64 // n_inner
    i1 = rows64 % n_inner
    x = tl.load(x_ptr + (i0 * stride_x0 + i1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + (i0 * stride_r0 + i1 * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0)
        s_x = (s + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(ro_ptr + (rows64 * stride_ro)[:, None] + cols[None, :], s_x, mask=mask)
        s = s_x.to(tl.float32)
    var = tl.sum(s * s, 1) / H
    h = s * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    else:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (h * w[None, :]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + (rows64 * stride_o)[:, None] + cols[None, :], out, mask=mask)


def _as_rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(n_rows, n_inner, stride0, stride1) addressing t's rows as row = i0 * n_inner + i1."""
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"rms_norm takes 1-3 dims, got {tuple(t.shape)}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim (with residual: of x + residual) -> out [or (out, x + residual)]."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, x.shape)
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-2], hidden)
    check_last_dim_contiguous("x", x)
    n_rows, n_inner, sx0, sx1 = _as_rows(x)
    out_dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.is_contiguous() and out.shape == x.shape, "out must be contiguous and shaped like x"
    has_res = residual is not None
    if has_res:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        residual = residual.reshape(x.shape)
        check_last_dim_contiguous("residual", residual)
        _, _, sr0, sr1 = _as_rows(residual)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        assert residual_out.is_contiguous() and residual_out.shape == x.shape
    else:
        sr0 = sr1 = 0
        residual = residual_out = x  # unused
    if n_rows == 0:
        return (out, residual_out) if has_res else out
    block_h = next_pow2(hidden)
    assert block_h <= 65536, "hidden size too large for a single-block row"
    block_r = max(1, min(16, 2048 // block_h))
    num_warps = max(1, min(16, block_h * block_r // 512))
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, residual, weight, out, residual_out,
        n_rows, n_inner, sx0, sx1, sr0, sr1, hidden, hidden,
        eps,
        H=hidden, BLOCK_H=block_h, BLOCK_R=block_r, HAS_RESIDUAL=has_res,
        ZERO_CENTERED=zero_centered, num_warps=num_warps, PDL=(on := pdl(x.device)), launch_pdl=on,
    )
    return (out, residual_out) if has_res else out
