"""Palu-style low-rank KV (Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank Projection").

Palu factors each layer's key and value projections by SVD, caches the low-rank latent of every token and
reconstructs keys and values from it inside attention. Implemented here per KV head (Palu's per-head
decomposition): for a head whose projection is ``W`` [D, hidden] (the key's per-head norm weight folded in,
see ``kv_projections``), the SVD ``W = U S V^T`` gives the basis ``U_r`` (the first ``r`` left singular
vectors, ``r = round(rank_ratio * D)``), and a token's latent is ``U_r^T (x - b)`` for its key or value
``x`` before RoPE (``b`` the projection's bias): exactly Palu's ``S_r V_r^T h`` for the token's hidden
state ``h``, so the reconstruction ``U_r latent + b`` is the token's projection through Palu's rank-``r``
factorisation of ``W``.

Keys reach the cache after RoPE, and RoPE does not commute with ``U_r``: each key is rotated back by its
logical position before the projection, its position is stored with the latent (an int32 field), and the
reconstruction rotates it forward again with the model's own cos/sin tables — Palu's "reconstruct, then
apply RoPE" inside attention. Values carry no position.

Fields per token and KV head: keys ``latent`` (``r`` values, ``latent_dtype``) + ``pos``; values ``latent``.
Bytes against bf16 at ``rank_ratio = 0.5``, fp16 latents, D = 128: keys 132 / 256, values 128 / 256.
Reconstruction is exact at ``rank_ratio = 1`` (up to the latent dtype) and for projections of rank <= r.
The bases depend on the weights, so the codec is bound to a model (``bind_model``) before it stores
anything. On a GPU the Triton backend's fused decode kernel (``agentrt_kernels.triton.lowrank_decode``) reads the
latents and reconstructs keys (basis, bias, RoPE) and values (once per split, in the latent space) inside
the attention loop; prefill chunks take the torch reference, a block of pages at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract.codec import FieldSpec, KVCodec, TensorCodec

LATENT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def head_bases(weights: torch.Tensor, rank: int) -> torch.Tensor:
    """weights [H, D, hidden] -> [H, D, rank]: each head's leading left singular vectors."""
    u, _, _ = torch.linalg.svd(weights.double(), full_matrices=False)
    return u[..., :rank].float().contiguous()


class _RotaryTables:
    """The model's RoPE as (cos, sin) per position (each [max_pos, D / 2], fp32), applied forward or back."""

    def __init__(self, rotary) -> None:
        self.cos = rotary.cos_cache.float()
        self.sin = rotary.sin_cache.float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, H, D] at positions [N] (every head) or [N, H] (per head: rows gathered head by head)."""
        index = positions if positions.dim() == 2 else positions[:, None]
        cos = self.cos.to(x.device)[index]
        sin = self.sin.to(x.device)[index]
        x1, x2 = x.chunk(2, dim=-1)
        if not inverse:
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        norm = cos * cos + sin * sin  # the tables may carry an attention scale (YaRN): undo it too
        return torch.cat(((x1 * cos + x2 * sin) / norm, (x2 * cos - x1 * sin) / norm), dim=-1)


class LowRank(TensorCodec):
    """One side of one layer: the latent ``U_r^T (x - b)`` (keys: of the key rotated back by its position)."""

    def __init__(self, rank: int, latent_dtype: torch.dtype, keys: bool, basis: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, rotary: _RotaryTables | None = None):
        self.rank, self.latent_dtype, self.keys = rank, latent_dtype, keys
        self.basis, self.bias, self.rotary = basis, bias, rotary  # [H, D, r], [H, D] or None
        self.needs_positions = keys

    def fields(self, head_dim: int) -> dict[str, FieldSpec]:
        out = {"latent": FieldSpec(self.rank, self.latent_dtype)}
        if self.keys:
            out["pos"] = FieldSpec(1, torch.int32)
        return out

    def _bound(self) -> torch.Tensor:
        if self.basis is None:
            raise RuntimeError("kv_storage 'palu' stores nothing before it is bound to a model (bind_model)")
        return self.basis

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        basis = self._bound().to(x.device)
        x = x.float()
        if self.keys:
            x = self.rotary.rotate(x, positions.long(), inverse=True)
        if self.bias is not None:
            x = x - self.bias.to(x.device)
        latent = torch.einsum("nhd,hdr->nhr", x, basis)
        out = {"latent": latent.to(self.latent_dtype)}
        if self.keys:
            out["pos"] = positions.to(torch.int32)[:, None, None].expand(-1, x.shape[1], 1)
        return out

    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        latent = fields["latent"].float()
        basis = self._bound().to(latent.device)
        x = torch.einsum("nhr,hdr->nhd", latent, basis)
        if self.bias is not None:
            x = x + self.bias.to(x.device)
        if self.keys:
            x = self.rotary.rotate(x, fields["pos"][..., 0].long())  # per head: compaction gathers head by head
        return x


@dataclass(slots=True, frozen=True)
class PaluConfig:
    rank_ratio: float = 0.5  # r = round(rank_ratio * head_dim) latent dimensions per KV head
    latent_dtype: str = "float16"

    def __post_init__(self) -> None:
        if isinstance(self.rank_ratio, bool) or not isinstance(self.rank_ratio, (int, float)) \
                or not 0.0 < self.rank_ratio <= 1.0:
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise ValueError(f"latent_dtype must be one of {sorted(LATENT_DTYPES)}, got {self.latent_dtype!r}")


class Palu(KVCodec):
    name = "palu"
    Config = PaluConfig
    kernel_format = "lowrank-latent-rope"
    latent_refusal = ("it factors each layer's per-head key and value projections; a latent (MLA) model caches "
                      "the output of one shared low-rank projection (kv_a_proj_with_mqa) instead, with no per-head "
                      "K and V to project")

    def __init__(self, config=None):
        super().__init__(config)
        self._layers: list[tuple[LowRank, LowRank]] = []
        self._kernel_tables: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.key = self.value = None  # set by check: the rank depends on the head size

    def rank(self, head_dim: int) -> int:
        return max(1, round(self.config.rank_ratio * head_dim))

    def check(self, spec) -> None:
        dtype = LATENT_DTYPES[self.config.latent_dtype]
        self.key = LowRank(self.rank(spec.head_dim), dtype, keys=True)
        self.value = LowRank(self.rank(spec.head_dim), dtype, keys=False)
        super().check(spec)

    def bind_model(self, model) -> None:
        rotary = _RotaryTables(model.rotary)
        dtype = LATENT_DTYPES[self.config.latent_dtype]
        self._layers, self._kernel_tables = [], {}
        for proj in model.kv_projections():
            r = self.rank(proj["k"].shape[1])
            self._layers.append((
                LowRank(r, dtype, True, head_bases(proj["k"], r), proj["k_bias"], rotary),
                LowRank(r, dtype, False, head_bases(proj["v"], r), proj["v_bias"])))

    def kernel_tables(self, head_dim: int, device: torch.device, layer: int = 0) -> dict[str, torch.Tensor]:
        """The layer's bases [Hkv, D, r], biases [Hkv, D] (zeros without) and RoPE tables, on ``device``."""
        key = (layer, str(device))
        if key not in self._kernel_tables:
            k, v = self._layers[layer]
            basis = k._bound()

            def bias(b):
                return torch.zeros(basis.shape[:2]) if b is None else b

            tables = {"k_basis": basis, "v_basis": v._bound(), "k_bias": bias(k.bias), "v_bias": bias(v.bias),
                      "cos": k.rotary.cos, "sin": k.rotary.sin}
            self._kernel_tables[key] = {n: t.to(device=device, dtype=torch.float32).contiguous()
                                        for n, t in tables.items()}
        return self._kernel_tables[key]

    def layer_codec(self, layer: int, side: str) -> TensorCodec:
        if not self._layers:
            return self.key if side == "k" else self.value  # unbound: fields only; encoding raises
        return self._layers[layer][0 if side == "k" else 1]
