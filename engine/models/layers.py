"""Building blocks shared by the decoder models, written to match Hugging Face numerics.

Parameters are created uninitialized (``torch.empty``) and filled by ``load_weights``. Each parameter may
carry ``weight_loader(param, tensor, shard_id)`` and ``shard_ids`` (the checkpoint pieces it needs; a
``shard_id`` of None means the whole parameter at once).
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError, ConfigError
from agentrt_kernels import ops
from agentrt_kernels.torch_ref.norm import rms_norm as torch_rms_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise CheckpointError(f"shape {tuple(src.shape)} does not match expected {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    assert shard_id is None
    copy_into(param.data, loaded)


def new_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """A projection every tensor-parallel rank holds whole (MoE routers, gates); see engine.parallel.layers."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size)
        self.bias = new_parameter(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Projections of one input packed along the output dim, held whole by every tensor-parallel rank (an MLA
    layer's query and latent down-projections: one GEMM for both); checkpoint shard i fills output rows
    ``[offset_i, offset_i + size_i)``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = tuple(output_sizes)
        self.offsets = tuple(sum(output_sizes[:i]) for i in range(len(output_sizes)))
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.load
                param.shard_ids = tuple(range(len(output_sizes)))

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            copy_into(param.data, loaded)
            return
        copy_into(param.data.narrow(0, self.offsets[shard_id], self.output_sizes[shard_id]), loaded)


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalize in fp32, cast back, then scale by the weight in the weight's dtype."""

    zero_centered = False  # the form a fused kernel taking this norm's weight must compute (ops.rms_norm)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(size)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with ``residual``: (norm(x + residual), x + residual). One fused kernel on a GPU."""
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) by the torch reference, on any device."""
        return torch_rms_norm(x, self.weight, self.eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate, then up) -> silu(gate) * up [..., I]; one kernel on a GPU."""
    return ops.silu_and_mul(x)


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32 on CPU, cos/sin scale) exactly as transformers' ROPE_INIT_FUNCTIONS.

    ``rotary_dim`` (default ``head_dim``): partial rotary, the leading channels of a head that rotate
    (``head_dim * partial_rotary_factor``); transformers computes every rope type's frequencies over that dim.
    A ``partial_rotary_factor`` left in ``rope_scaling`` is refused: the caller resolves it into ``rotary_dim``."""
    head_dim = head_dim if rotary_dim is None else rotary_dim
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if (rope_scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling), 1.0
    return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor, low_freq_factor, high_freq_factor = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a cos/sin cache for positions [0, max_position_embeddings).

    The cache is computed in fp32 (positions * inv_freq, then cos/sin, times the scale) and stored in the
    model dtype, so the rotation runs in the model dtype on exactly the values HF's rotary module produces.

    ``rotary_dim`` < ``head_dim`` (partial rotary, Qwen3-Next / Qwen3.5): only the first ``rotary_dim`` channels
    of each head rotate (rotate-half within them), the rest pass through; the cache is ``[max_pos, rotary_dim/2]``.
    """

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim {head_dim}]")
        inv_freq, scale = rope_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings,
                                        rotary_dim=self.rotary_dim)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_cache", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scale).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, Hq, D], k [T, Hkv, D] -> rotated q, k (same shapes and dtype).

        On a GPU one Triton kernel rotates q and k in place (with a partial ``rotary_dim``, their leading
        channels; the cache's width tells the kernel)."""
        return ops.apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)
