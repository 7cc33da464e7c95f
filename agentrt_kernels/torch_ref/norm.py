"""Reference RMSNorm (HF LlamaRMSNorm), optionally after the residual add: what ``agentrt_kernels.triton.norm``
fuses into one kernel."""

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) over the last dim, or with ``residual``: (norm(x + residual), x + residual). Normalizes in fp32,
    casts back to x's dtype, then scales by ``weight`` in the weight's dtype."""
    if residual is not None:
        residual = x + residual
        return _norm(residual, weight, eps), residual
    return _norm(x, weight, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
