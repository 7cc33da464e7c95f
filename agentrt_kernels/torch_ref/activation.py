"""Reference SwiGLU activation: what ``agentrt_kernels.triton.activation`` computes in one kernel."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate columns first, then up) -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
