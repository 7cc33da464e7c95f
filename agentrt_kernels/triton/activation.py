"""SwiGLU activation: ``silu_and_mul(x [..., 2I]) -> [..., I]`` = silu(x[..., :I]) * x[..., I:].

Matches agentrt_kernels.torch_ref.activation.silu_and_mul (gate first half, up second half) including its rounding in
low precision: silu is computed in fp32 and rounded to x.dtype (as torch's F.silu does), then multiplied
by ``up`` in fp32 and rounded again. x may be any [..., 2I] tensor whose last dim is contiguous (row
stride free); the output is a new contiguous tensor. Grid (rows, cdiv(I, BLOCK)); memory-bound, one read
and one write per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt_kernels.triton._common import check_last_dim_contiguous, next_pow2, pdl, pdl_enter


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (act * up).to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] -> silu(gate) * up, [..., I] in x's dtype."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0, x.shape
    inter = two_i // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, two_i)
    check_last_dim_contiguous("x", x2)
    if out is None:
        out = torch.empty((*lead, inter), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block, num_warps=max(1, min(4, block // 256)),
        PDL=(on := pdl(x.device)), launch_pdl=on,
    )
    return out
