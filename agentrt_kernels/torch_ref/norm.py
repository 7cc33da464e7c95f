"""Reference RMSNorm (HF LlamaRMSNorm), optionally after the residual add: what ``agentrt_kernels.triton.norm``
fuses into one kernel."""

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) over the last dim, or with ``residual``: (norm(x + residual), x + residual). Normalizes in fp32,
    casts back to x's dtype, then scales by ``weight`` in the weight's dtype. ``zero_centered``: Qwen3-Next's
    norm instead (``_zero_centered_norm``)."""
    norm = _zero_centered_norm if zero_centered else _norm
    if residual is not None:
        residual = x + residual
        return norm(residual, weight, eps), residual
    return norm(x, weight, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _zero_centered_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNorm: normalizes in fp32, scales by ``1 + weight`` in fp32, then casts to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm (the DeltaNet's output norm): ``_norm`` of x's last dim (not zero-centred), times
    SiLU(gate) taken in fp32, cast back to x's dtype."""
    h = _norm(x, weight, eps)
    return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
