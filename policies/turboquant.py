"""TurboQuant-style KV (Zandieh et al., 2025): a seeded random rotation, then a scalar Lloyd-Max quantizer.

Each (token, KV head) vector x is stored as its norm ||x|| (fp32) and the ``bits``-bit indices of the
coordinates of y = Pi x / ||x||, where Pi is a random orthogonal matrix (QR of a seeded Gaussian). Every
coordinate of a uniformly random unit vector in R^d has density f(t) ~ (1 - t^2)^((d - 3) / 2) on [-1, 1]
(about N(0, 1/d)); the codebook is the Lloyd-Max quantizer of that density (computed once per (d, bits) by
Lloyd's iteration on a fine grid), so E ||u - u^||^2 is the per-coordinate Lloyd-Max distortion times d.
Decoding is x^ = ||x|| Pi^T c[idx]. Indices are stored as ``bits`` bit-planes of d / 8 bytes each.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from engine.contract.codec import FieldSpec, KVCodec, TensorCodec


@lru_cache(maxsize=None)
def lloyd_max_codebook(dim: int, bits: int, iters: int = 200, grid: int = 8001) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels [2^bits], boundaries [2^bits - 1]) fp64 for one coordinate of a random unit vector in R^dim."""
    t = torch.linspace(-1, 1, grid, dtype=torch.float64)
    dens = (1 - t * t).clamp_min(0) ** ((dim - 3) / 2)
    dens = dens / dens.sum()
    n = 1 << bits
    cdf = dens.cumsum(0)
    levels = torch.stack([t[torch.searchsorted(cdf, (i + 0.5) / n).clamp(max=grid - 1)] for i in range(n)])
    for _ in range(iters):
        bounds = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(t, bounds)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, dens)
        first = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, dens * t)
        levels = torch.where(mass > 0, first / mass.clamp_min(1e-300), levels)
    return levels, (levels[1:] + levels[:-1]) / 2


@lru_cache(maxsize=None)
def rotation(dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def pack_bitplanes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx [..., D] (< 2^bits) -> [..., bits * D / 8] uint8: plane p holds bit p of every index, 8 per byte."""
    weights = (1 << torch.arange(8, device=idx.device, dtype=torch.int32))
    planes = []
    for p in range(bits):
        bit = ((idx.to(torch.int32) >> p) & 1).unflatten(-1, (-1, 8))
        planes.append((bit * weights).sum(-1).to(torch.uint8))
    return torch.cat(planes, -1)


def unpack_bitplanes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    idx = 0
    for p, plane in enumerate(packed.chunk(bits, -1)):
        idx = idx + ((((plane.to(torch.int32)[..., None] >> shifts) & 1) << p).flatten(-2))
    return idx.long()


class RotatedLloydMax(TensorCodec):
    def __init__(self, bits: int, seed: int):
        self.bits, self.seed = bits, seed
        self._device_tables: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}

    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        return {"codes": FieldSpec(head_dim * self.bits // 8, torch.uint8), "norm": FieldSpec(1, torch.float32)}

    def _tables(self, dim: int, device: torch.device):
        key = (dim, str(device))
        if key not in self._device_tables:
            levels, bounds = lloyd_max_codebook(dim, self.bits)
            self._device_tables[key] = (rotation(dim, self.seed).to(device), levels.float().to(device),
                                        bounds.float().to(device))
        return self._device_tables[key]

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        pi, _, bounds = self._tables(x.shape[-1], x.device)
        x = x.float()
        norm = x.norm(dim=-1, keepdim=True)
        y = (x / norm.clamp_min(torch.finfo(torch.float32).tiny)) @ pi.T
        return {"codes": pack_bitplanes(torch.bucketize(y, bounds), self.bits), "norm": norm}

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        pi, levels, _ = self._tables(head_dim, fields["norm"].device)
        y = levels[unpack_bitplanes(fields["codes"], self.bits)]
        return fields["norm"] * (y @ pi)


@dataclass(slots=True, frozen=True)
class TurboQuantConfig:
    bits: int = 3
    seed: int = 0

    def __post_init__(self):
        if self.bits not in (2, 3, 4):
            raise ValueError(f"bits must be 2, 3 or 4, got {self.bits!r}")


class TurboQuant(KVCodec):
    name = "turboquant"
    Config = TurboQuantConfig
    latent_refusal = ("it rotates and normalizes each vector whole, so in a latent row the rotary channels' error "
                      "would follow the RMS-normed latent's norm (or the reverse), and the values, the row's first "
                      "channels, are no slice of its rotated codes (its kernel attends in the rotated basis)")

    def __init__(self, config=None):
        super().__init__(config)
        self.key = self.value = RotatedLloydMax(self.config.bits, self.config.seed)
        self.kernel_format = "lloydmax-rotated-bitplanes"

    def kernel_tables(self, head_dim, device, layer=0):
        pi, levels, _ = self.key._tables(head_dim, device)
        return {"rotation": pi, "levels": levels}

    def check(self, spec) -> None:
        super().check(spec)
        from engine.errors import ConfigError

        if spec.head_dim % 8:
            raise ConfigError(f"kv_storage 'turboquant': head_dim {spec.head_dim} must be a multiple of 8")
