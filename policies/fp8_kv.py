"""FP8 KV: every (token, KV head) vector stored as E4M3 codes with one fp32 scale (its absolute max / 448).

E4M3 keeps 3 mantissa bits, so each element's relative rounding error is at most 2^-4 (subnormals, below
2^-6 of the scale's range, lose relative precision but stay within 2^-10 * scale absolutely).
"""

from dataclasses import dataclass

import torch

from engine.contract.codec import FieldSpec, KVCodec, TensorCodec

E4M3_MAX = 448.0


class E4M3PerHead(TensorCodec):
    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        return {"codes": FieldSpec(head_dim, torch.uint8), "scale": FieldSpec(1, torch.float32)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return {"codes": codes, "scale": scale}

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        return fields["codes"].view(torch.float8_e4m3fn).float() * fields["scale"]


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
