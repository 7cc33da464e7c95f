"""Latent KV (multi-head latent attention): one row per token and layer, ``[num_layers, num_pages, page_size,
1, head_dim]``, whose first ``value_dim`` channels are the values.

A latent-attention model (``engine.models.mla``) hands attention one "KV head" whose key is the whole row
(latent, then the rotated shared key) and whose value is the latent alone; the storage keeps the row once and
serves the values as a view of its first ``value_dim`` channels, so a token costs ``head_dim`` values per layer
instead of ``head_dim + value_dim``. Pages, prefix reuse, compaction and chain tables work as for dense KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt_kernels import ops
from engine.contract.cache import CacheSpec
from engine.contract.storage import KVStorage, TableHandle
from engine.kv_memory import zeroed


@dataclass(slots=True, frozen=True)
class LatentCacheSpec(CacheSpec):
    """``num_kv_heads`` rows of ``head_dim`` per token and layer; values are their first ``value_dim`` channels."""

    value_dim: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.value_dim <= self.head_dim:
            raise ValueError(f"value_dim {self.value_dim} must lie in [1, head_dim {self.head_dim}]")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def v_head_dim(self) -> int:
        return self.value_dim


class LatentKV(KVStorage):
    def __init__(self, spec: LatentCacheSpec, num_pages: int):
        super().__init__(spec, num_pages)
        self.rows = zeroed((spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim),
                           spec.dtype, spec.device)

    def write(self, layer, k, v, slots, positions=None) -> None:
        """``v`` is ``k``'s first ``value_dim`` channels (the model's view of one row): only ``k`` is stored."""
        self.rows[layer].flatten(0, 1)[slots] = k.to(self.rows.dtype)

    def row_target(self, layer):
        """On a GPU the rows themselves (``ops.latent_inputs`` stores a step's rows as it makes them)."""
        return self.rows[layer].view(-1, self.spec.head_dim) if ops.uses_triton(self.rows) else None

    def write_prefix(self, table: TableHandle, layer, k, v, slots) -> None:
        self.rows[layer].flatten(0, 1)[slots] = k.to(self.rows.dtype)

    def copy_pages(self, src, dst) -> None:
        self.rows[:, dst] = self.rows[:, src]

    def gather_kept(self, layer, table, old_slots, keep):
        head_idx = torch.arange(keep.shape[0], device=keep.device)[None, :]
        return self.rows[layer].flatten(0, 1)[old_slots[keep.T], head_idx]

    def scatter_kept(self, layer, table, kept, new_slots) -> None:
        self.rows[layer].flatten(0, 1)[new_slots[: kept.shape[0]]] = kept

    def page_tensors(self):
        return [(self.rows, 1)]

    def layer_kv(self, layer):
        rows = self.rows[layer]
        return rows, rows[..., : self.spec.value_dim]

    def all_layer_keys(self):
        """The rows [L, P, ...] as L * P pages: layer l's page p is page P * l + p."""
        return self.rows.view(-1, *self.rows.shape[2:]), self.rows.shape[1]
