"""KIVI (Liu et al., 2024): asymmetric 2/4-bit KV; keys per channel, values per token, recent tokens kept whole.

* Keys: per (KV head, channel), one (scale, zero) over each ``group_size`` consecutive tokens.
* Values: per (token, KV head), one (scale, zero) over each ``group_size`` consecutive channels.
* The ``residual`` most recent tokens (plus the incomplete key group) are attended in full precision
  (the cache's window); their codes are kept valid too (an incomplete group is re-encoded as it fills).

Quantization of a group with minimum m and maximum M: zero z = m and scale s = (M - z) / (2^b - 1), both
stored as fp16 (z rounded down and s up, so every element stays inside the code range); code
q = round((x - z) / s) in [0, 2^b - 1], x^ = q s + z, hence |x - x^| <= s / 2.
Codes pack 8 / b per byte in planes: byte j holds channels j + p D (b / 8), p = 0 .. 8/b - 1, at bit p b
(a kernel reads plane p as a contiguous channel range; no interleaving).
"""

from dataclasses import dataclass

import torch

from engine.contract.codec import FieldSpec, KVCodec, TensorCodec
from agentrt_kernels import ops


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] uint8 < 2^bits -> [..., D * bits / 8] uint8 (plane layout)."""
    planes = 8 // bits
    parts = codes.chunk(planes, dim=-1)
    out = torch.zeros_like(parts[0])
    for p, part in enumerate(parts):
        out |= part << (p * bits)
    return out


def unpack_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (p * bits)) & mask for p in range(8 // bits)], dim=-1)


def half_step(x: torch.Tensor, up: bool) -> torch.Tensor:
    """The next fp16 value above (``up``) or below x (finite x), through the bit pattern on any device."""
    bits = x.view(torch.int16).to(torch.int32)
    away = bits + 1  # one ulp further from zero (sign-magnitude)
    toward = bits - 1
    positive = bits >= 0
    stepped = torch.where(positive == up, away, toward)
    stepped = torch.where(x == 0, torch.full_like(bits, 1 if up else -32767), stepped)
    return stepped.to(torch.int16).view(torch.float16)


def asym_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero) with zero <= lo and zero + (2^b - 1) scale >= hi."""
    levels = (1 << bits) - 1
    zero = lo.half()
    zero = torch.where(zero.float() > lo, half_step(zero, up=False), zero)
    scale = ((hi - zero.float()) / levels).half()
    short = scale.float() * levels + zero.float() < hi
    scale = torch.where(short, half_step(scale, up=True), scale)
    return scale, zero


def asym_quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale.float()
    q = ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round()
    return q.clamp(0, (1 << bits) - 1).to(torch.uint8)


def use_kernel(x: torch.Tensor) -> bool:
    """Whether ``store`` encodes with the fused Triton kernel (``agentrt_kernels/triton/asym_encode.py``): where
    ``agentrt_kernels.ops.uses_triton`` (on a GPU)."""
    return ops.uses_triton(x)


def fused_store(x, slots, fields, bits: int, group: int, kernel) -> bool:
    """Encode and store with ``kernel`` (``ops.asym_encode_channel_groups`` or ``ops.asym_encode_token_groups``)
    where it applies; False if it did not."""
    if not use_kernel(x) or not ops.asym_encode_supported(x.shape[-1], bits, group):
        return False
    kernel(x, slots, fields["codes"], fields["scale"], fields["zero"], bits, group)
    return True


class PerChannelKeys(TensorCodec):
    def __init__(self, bits: int, group_size: int):
        self.bits, self.token_group = bits, group_size

    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        return {"codes": FieldSpec(head_dim * self.bits // 8, torch.uint8),
                "scale": FieldSpec(head_dim, torch.float16, per_group=True),
                "zero": FieldSpec(head_dim, torch.float16, per_group=True)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        n, h, d = x.shape
        g = x.float().view(n // self.token_group, self.token_group, h, d)
        scale, zero = asym_params(g.amin(1), g.amax(1), self.bits)
        codes = asym_quantize(g, scale[:, None], zero[:, None], self.bits).view(n, h, d)
        return {"codes": pack_planes(codes, self.bits), "scale": scale, "zero": zero}

    def store(self, x, slots, fields, positions=None) -> None:
        if not fused_store(x, slots, fields, self.bits, self.token_group, ops.asym_encode_channel_groups):
            super().store(x, slots, fields, positions)

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        codes = unpack_planes(fields["codes"], self.bits).float()
        return codes * fields["scale"].float() + fields["zero"].float()


class PerTokenValues(TensorCodec):
    def __init__(self, bits: int, group_size: int):
        self.bits, self.channel_group = bits, group_size

    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        groups = head_dim // self.channel_group
        return {"codes": FieldSpec(head_dim * self.bits // 8, torch.uint8),
                "scale": FieldSpec(groups, torch.float16), "zero": FieldSpec(groups, torch.float16)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        n, h, d = x.shape
        g = x.float().view(n, h, d // self.channel_group, self.channel_group)
        scale, zero = asym_params(g.amin(-1), g.amax(-1), self.bits)
        codes = asym_quantize(g, scale[..., None], zero[..., None], self.bits).view(n, h, d)
        return {"codes": pack_planes(codes, self.bits), "scale": scale, "zero": zero}

    def store(self, x, slots, fields, positions=None) -> None:
        if not fused_store(x, slots, fields, self.bits, self.channel_group, ops.asym_encode_token_groups):
            super().store(x, slots, fields, positions)

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        codes = unpack_planes(fields["codes"], self.bits).float()
        scale = fields["scale"].float().repeat_interleave(self.channel_group, -1)
        zero = fields["zero"].float().repeat_interleave(self.channel_group, -1)
        return codes * scale + zero


@dataclass(slots=True, frozen=True)
class KiviConfig:
    bits: int = 4
    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if not isinstance(self.residual, int) or self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"residual must be a non-negative multiple of group_size, got {self.residual!r}")


class Kivi(KVCodec):
    name = "kivi"
    Config = KiviConfig
    latent_refusal = ("its keys are quantized per channel over groups of tokens and its values per token over "
                      "groups of channels, so a latent row, which is both the key and (its first channels) the "
                      "value, would need both codes: stored twice")

    def __init__(self, config=None):
        super().__init__(config)
        c = self.config
        self.key = PerChannelKeys(c.bits, c.group_size)
        self.value = PerTokenValues(c.bits, c.group_size)
        self.residual = c.residual
        self.kernel_format = f"int{c.bits}-asym-kchan-vtok"

    def check(self, spec) -> None:
        super().check(spec)
        from engine.errors import ConfigError

        c = self.config
        if spec.head_dim % c.group_size or spec.head_dim % (8 // c.bits):
            raise ConfigError(f"kv_storage 'kivi': head_dim {spec.head_dim} must be a multiple of group_size "
                              f"{c.group_size} (value channel groups) and of {8 // c.bits} (code planes)")
