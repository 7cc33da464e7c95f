"""FP8 KV: every (token, KV head) vector stored as E4M3 codes with one fp32 scale (its absolute max / 448).

E4M3 keeps 3 mantissa bits, so each element's relative rounding error is at most 2^-4 (subnormals, below
2^-6 of the scale's range, lose relative precision but stay within 2^-10 * scale absolutely).

On a latent (MLA) cache the one row per token and layer (``kv_lora_rank`` latent channels, then
``qk_rope_head_dim`` rotated key channels) is coded once, values being its decoded first channels: one E4M3 code
per channel, one fp32 scale for the latent part and one for the rotary part (``E4M3LatentRow``).
"""

from dataclasses import dataclass

import torch

from engine.contract.codec import FieldSpec, KVCodec, TensorCodec

E4M3_MAX = 448.0


def e4m3_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] uint8, scale [..., 1] fp32): E4M3 of x / scale, scale = amax / 448."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def e4m3_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() * scale


class E4M3PerHead(TensorCodec):
    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        return {"codes": FieldSpec(head_dim, torch.uint8), "scale": FieldSpec(1, torch.float32)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = e4m3_encode(x)
        return {"codes": codes, "scale": scale}

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        return e4m3_decode(fields["codes"], fields["scale"])


class E4M3LatentRow(TensorCodec):
    """A latent row ``[latent (latent_dim channels), rotary key (the rest)]``: one E4M3 code per channel, an
    fp32 scale (amax / 448) for the latent part (``scale``) and one for the rotary part (``rope_scale``).

    Why two scales: the latent is RMS-normed while the rotary key is not, and in trained checkpoints the rotary
    channels can be much larger; under one scale per row the latent's small elements then fall below E4M3's
    normal range (2^-6 of the scale) and lose their relative precision or flush to zero. Two scales keep the
    latent's precision independent of the rotary magnitude, for 4 bytes a row (docs/methods.md gives the
    measured errors both ways)."""

    kernel_format = "e4m3-latent-row"  # the Triton MLA decode kernel reads these codes and scales

    def __init__(self, latent_dim: int):
        self.latent_dim = latent_dim

    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        return {"codes": FieldSpec(head_dim, torch.uint8), "scale": FieldSpec(1, torch.float32),
                "rope_scale": FieldSpec(1, torch.float32)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        latent, latent_scale = e4m3_encode(x[..., : self.latent_dim])
        rope, rope_scale = e4m3_encode(x[..., self.latent_dim:])
        return {"codes": torch.cat([latent, rope], -1), "scale": latent_scale, "rope_scale": rope_scale}

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        codes, d = fields["codes"], self.latent_dim
        return torch.cat([e4m3_decode(codes[..., :d], fields["scale"]),
                          e4m3_decode(codes[..., d:], fields["rope_scale"])], -1)


@dataclass(slots=True, frozen=True)
class FP8Config:
    pass


class FP8KV(KVCodec):
    name = "fp8"
    Config = FP8Config
    kernel_format = "e4m3-token-head"

    def __init__(self, config=None):
        super().__init__(config)
        self.key = self.value = E4M3PerHead()

    def latent_codec(self, head_dim: int, value_dim: int) -> TensorCodec:
        """A latent row with a rotary part: ``E4M3LatentRow``; without one, the per-head format (one scale)."""
        return E4M3LatentRow(value_dim) if value_dim < head_dim else E4M3PerHead()
