"""The storage side of the contract: how each retained token's KV is stored (independent of which are kept).

A ``KVCodec`` pairs two ``TensorCodec`` s (keys, values). A tensor codec stores one token of one KV head as a
few fixed-width *fields* (codes, scales, zeros, norms...). A field is either per token or per *token group*
(``token_group`` consecutive slots share it, e.g. per-channel key scales over a run of tokens); the cache
manager keeps each field in a page-shaped side tensor ``[num_pages, page_size // g, num_kv_heads, width]``
(g = 1 or ``token_group``) and moves them together on compaction.

A codec whose groups span tokens, or that keeps recent tokens in full precision (``residual``), has a
*window*: each running request's slots ``[quant_len(n), n)`` also live in a full-precision ring of
``window_capacity`` slots (slot ``s`` at ``s % window_capacity``); attention reads the ring for them and the
codes for older slots. The codes of every slot are kept valid at all times (an incomplete group is encoded
with the statistics of the tokens it has and re-encoded as it fills), so pages can be shared, published and
read without the ring.

A latent (MLA) cache holds one row per token whose first channels are also the values; a format that can code
such a row once returns a tensor codec for it from ``KVCodec.latent_codec`` (token-local, no window); the others
refuse with their reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from math import lcm
from typing import Any, ClassVar

import torch

from engine.contract.cache import CacheSpec
from engine.contract.options import build_config
from engine.errors import ConfigError


@dataclass(slots=True, frozen=True)
class FieldSpec:
    width: int  # elements per (token or group, head)
    dtype: torch.dtype
    per_group: bool = False  # one entry per ``token_group`` slots instead of per slot

    def nbytes(self) -> int:
        return self.width * self.dtype.itemsize


class TensorCodec(ABC):
    """Stores one side (K or V) of each token, per KV head."""

    token_group: int = 1  # slots sharing the per-group fields
    needs_positions: ClassVar[bool] = False  # ``encode`` takes the slots' logical positions (e.g. to undo RoPE)
    # the layout a GPU kernel reads this codec's fields in (a latent row codec's, e.g. "e4m3-latent-row"; None:
    # attention reads the decoded rows through the torch reference)
    kernel_format: ClassVar[str | None] = None

    @abstractmethod
    def fields(self, head_dim: int) -> dict[str, FieldSpec]: ...

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [N, H, D] (N a multiple of ``token_group``, groups consecutive) -> each field as [N, H, w] or,
        per group, [N // token_group, H, w]. With ``needs_positions``: ``encode(x, positions)``, positions
        [N] int64 the tokens' logical positions."""

    def store(self, x: torch.Tensor, slots: torch.Tensor, fields: dict[str, torch.Tensor],
              positions: torch.Tensor | None = None) -> None:
        """Encode x [N, H, D] (as ``encode``) into the side tensors ``fields`` (flattened: [num_slots, H, w], per
        group [num_slots // token_group, H, w]) at physical ``slots`` [N] (a group's fields at its first slot
        // token_group). ``encode`` then one index copy per field; a codec may fuse both into one kernel."""
        encoded = self.encode(x, positions) if self.needs_positions else self.encode(x)
        specs = self.fields(x.shape[-1])
        for name, value in encoded.items():
            dst = fields[name]
            idx = slots[:: self.token_group] // self.token_group if specs[name].per_group else slots
            dst.index_copy_(0, idx, value.to(dst.dtype))

    @abstractmethod
    def decode(self, fields: dict[str, torch.Tensor], head_dim: int) -> torch.Tensor:
        """The inverse on N slots, every field given per slot ([N, H, w]; see ``expand_groups``) -> [N, H, D]
        fp32."""

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        """Bytes one token costs in one layer, per-group fields amortised over their group."""
        total = 0.0
        for f in self.fields(head_dim).values():
            total += f.nbytes() / (self.token_group if f.per_group else 1)
        return total * num_heads


def expand_groups(codec: TensorCodec, fields: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """Fields of whole groups as ``encode`` returns them -> every field per slot (what ``decode`` takes)."""
    specs = codec.fields(head_dim)
    return {k: v.repeat_interleave(codec.token_group, 0) if specs[k].per_group else v for k, v in fields.items()}


def decode_pages(codec: TensorCodec, layer_fields: dict[str, torch.Tensor], pages: torch.Tensor,
                 head_dim: int) -> torch.Tensor:
    """layer_fields: one layer's side tensors ([num_pages, page_size // g, H, w]); pages [n] -> the n pages'
    slots decoded, [n * page_size, H, D] fp32."""
    specs = codec.fields(head_dim)
    per_slot = {}
    for k, t in layer_fields.items():
        x = t[pages]
        if specs[k].per_group:
            x = x.repeat_interleave(codec.token_group, 1)
        per_slot[k] = x.flatten(0, 1)
    return codec.decode(per_slot, head_dim)


class KVCodec:
    """A storage format for a whole KV cache. Subclasses live in ``policies/`` and register by name."""

    name: ClassVar[str] = "base"
    Config: ClassVar[type] = type(None)
    kernel_format: ClassVar[str | None] = None  # the fused GPU decode kernel's format, if one exists

    key: TensorCodec
    value: TensorCodec
    residual: int = 0  # most recent tokens also kept in full precision

    def __init__(self, config: Any = None):
        self.config = config if config is not None else self.Config()

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> KVCodec:
        return cls(build_config(cls.Config, options, f"kv_storage {cls.name!r}"))

    @property
    def group(self) -> int:
        return lcm(self.key.token_group, self.value.token_group)

    @property
    def has_window(self) -> bool:
        return self.residual > 0 or self.group > 1

    @property
    def window_capacity(self) -> int:
        return self.residual + self.group if self.has_window else 0

    def quant_len(self, n: int) -> int:
        """Slots of an ``n``-slot request that attention reads from codes (the rest from the window)."""
        if not self.has_window:
            return n
        return max(0, (n - self.residual) // self.group * self.group)

    def quant_lens(self, n: torch.Tensor) -> torch.Tensor:
        """``quant_len`` of each of the lengths ``n`` (a tensor, on its device)."""
        if not self.has_window:
            return n
        return torch.clamp((n - self.residual) // self.group * self.group, min=0).to(n.dtype)

    def bytes_per_token(self, spec: CacheSpec) -> float:
        per_layer = (self.key.bytes_per_token(spec.num_kv_heads, spec.head_dim)
                     + self.value.bytes_per_token(spec.num_kv_heads, spec.head_dim))
        return per_layer * spec.num_layers

    def layer_codec(self, layer: int, side: str) -> TensorCodec:
        """The tensor codec of ``side`` ("k" or "v") in ``layer``: ``key`` / ``value`` unless the format differs
        by layer (e.g. a basis computed from each layer's weights). Every layer's fields match ``key`` /
        ``value``'s."""
        return self.key if side == "k" else self.value

    def bind_model(self, model: Any) -> None:
        """Called once with the loaded model, before any KV is stored (a codec derived from the weights)."""

    def kernel_tables(self, head_dim: int, device: torch.device, layer: int = 0) -> dict[str, torch.Tensor]:
        """Constant tensors the fused decode kernel of ``kernel_format`` reads besides ``layer``'s fields (e.g.
        a codebook and a rotation, or a layer's own bases); none by default. Called at every decode step (and
        captured into CUDA graphs): return the same tensors each time."""
        return {}

    # why the format cannot store a latent (MLA) row once, for the ConfigError ``latent_codec`` raises
    latent_refusal: ClassVar[str] = "it codes dense keys and values per KV head"

    def latent_codec(self, head_dim: int, value_dim: int) -> TensorCodec:
        """The tensor codec of a latent (MLA) cache's rows: each token's one row of ``head_dim`` channels, the
        latent (its first ``value_dim`` channels, also the values) then the rotary key, coded once
        (``engine.storage.coded_latent``; values are read as the decoded row's first ``value_dim`` channels, so
        nothing is stored twice). It must be token-local (``token_group`` 1) and the codec windowless. A format
        that cannot store a row once raises ConfigError with its ``latent_refusal`` (the default)."""
        raise ConfigError(f"kv_storage {self.name!r} cannot code latent (MLA) rows: {self.latent_refusal}")

    def check(self, spec: CacheSpec) -> None:
        """Raise ConfigError if this codec cannot store ``spec``'s KV."""
        if spec.page_size % self.group:
            raise ConfigError(f"kv_storage {self.name!r} groups {self.group} tokens; page_size {spec.page_size} "
                              "must be a multiple of it")


@dataclass(slots=True, frozen=True)
class CodedCacheSpec(CacheSpec):
    """A ``CacheSpec`` whose tokens are stored by ``codec``; ``max_windows`` running requests hold a
    full-precision window each (their bytes come out of the same budget)."""

    codec: KVCodec | None = None
    max_windows: int = 0

    @property
    def bytes_per_token(self) -> int:
        return int(self.bytes_per_page // self.page_size)

    @property
    def bytes_per_page(self) -> int:
        return int(round(self.codec.bytes_per_token(self) * self.page_size))

    @property
    def window_bytes(self) -> int:
        c = self.codec
        return (self.max_windows * c.window_capacity * 2 * self.num_layers * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)


def check_composes(codec: KVCodec, method_name: str, view_types: tuple[type, ...]) -> None:
    """A codec wraps the dense paged view; a method whose ``select`` builds another view type (page or slot
    selection) would hand the backend a view that does not describe the stored codes."""
    from engine.contract.view import PagedView

    others = [t.__name__ for t in view_types if t is not PagedView]
    if others:
        raise ConfigError(f"kv_storage {codec.name!r} does not compose with method {method_name!r}: its select "
                          f"returns {others}, which read full-precision pages")
