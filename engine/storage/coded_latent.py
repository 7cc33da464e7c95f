"""Latent KV (multi-head latent attention) stored by a codec: each token's one latent row per layer coded once.

The row (``kv_lora_rank`` latent channels, then the rotated shared key) is the one KV head's key, and its first
``value_dim`` channels are the values (``engine.storage.latent``). Coded, the row is handed to the codec's latent
tensor codec (``KVCodec.latent_codec``) whole: per field a page-shaped tensor ``[num_layers, num_pages,
page_size, 1, width]``, and nothing else. Values are read as the decoded row's first ``value_dim`` channels,
never coded or stored apart, so a token costs the codec's bytes for one row per layer
(``CodedLatentCacheSpec.bytes_per_token``), which sizes the pool and admission.

The latent tensor codec is token-local and the codec windowless (checked when the spec is built): every slot is
read from codes, compaction moves a kept slot's fields exactly, and a table can be cut anywhere, as for the
uncoded latent storage. Attention reads a ``QuantizedLatentView``.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields

import torch

from engine.contract.codec import KVCodec, TensorCodec
from engine.contract.storage import KVStorage, TableHandle
from engine.contract.view import QuantizedLatentView
from engine.errors import ConfigError
from engine.kv_memory import zeroed
from engine.storage.latent import LatentCacheSpec


@dataclass(slots=True, frozen=True)
class CodedLatentCacheSpec(LatentCacheSpec):
    """A ``LatentCacheSpec`` whose rows are stored by ``codec``'s latent tensor codec ``row``."""

    codec: KVCodec | None = None
    row: TensorCodec | None = None

    @property
    def bytes_per_token(self) -> int:
        return int(self.num_layers * self.row.bytes_per_token(self.num_kv_heads, self.head_dim))


def coded_latent_spec(spec: LatentCacheSpec, codec: KVCodec, max_running: int) -> CodedLatentCacheSpec:
    """``spec``'s rows stored by ``codec`` (ConfigError where the codec cannot code a row once)."""
    row = codec.latent_codec(spec.head_dim, spec.value_dim)
    if codec.has_window or row.token_group != 1:
        raise ConfigError(f"kv_storage {codec.name!r} groups tokens or keeps a full-precision window; a latent "
                          "(MLA) cache codes each row alone")
    codec.check(spec)
    return CodedLatentCacheSpec(**{f.name: getattr(spec, f.name) for f in dataclass_fields(LatentCacheSpec)},
                                codec=codec, row=row)


class DecodedRows:
    """A read-only ``[num_pages, page_size, 1, width]`` view of one layer's rows (``width`` = the row, for keys;
    its first ``value_dim`` channels, for values) decoded on indexing (``x.flatten(0, 1)[slots]``), in the cache
    dtype, for methods that score stored keys and for the probe."""

    def __init__(self, storage: CodedLatentKV, layer: int, width: int):
        self.storage, self.layer, self.width = storage, layer, width
        s = storage.spec
        self.shape = (storage.num_pages, s.page_size, s.num_kv_heads, width)
        self.dtype = s.dtype

    def flatten(self, start: int, end: int) -> DecodedRows:
        assert (start, end) == (0, 1)
        return self

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return self.storage.decode_slots(self.layer, slots)[..., : self.width].to(self.dtype)


class CodedLatentKV(KVStorage):
    per_layer_views = True  # each layer's view holds that layer's fields

    def __init__(self, spec: CodedLatentCacheSpec, num_pages: int):
        super().__init__(spec, num_pages)
        self.codec, self.row = spec.codec, spec.row
        self.fields = {name: zeroed((spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, f.width),
                                    f.dtype, spec.device)
                       for name, f in self.row.fields(spec.head_dim).items()}
        # per layer: the fields as views (every step's per-layer attention views hold them) and flattened to slots
        self.per_layer_fields = [{name: t[layer] for name, t in self.fields.items()}
                                 for layer in range(spec.num_layers)]
        self.flat_fields = [{name: t.flatten(0, 1) for name, t in f.items()} for f in self.per_layer_fields]

    def page_tensors(self):
        return [(t, 1) for t in self.fields.values()]

    # --- encode / decode ------------------------------------------------------------------------
    def gather_fields(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field at physical ``slots`` ([N] -> [N, 1, w]; [1, N] -> [N, 1, w])."""
        idx = slots.reshape(-1)
        return {name: flat[idx] for name, flat in self.flat_fields[layer].items()}

    def decode_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows at physical ``slots``, decoded: [N, 1, head_dim] fp32."""
        return self.row.decode(self.gather_fields(layer, slots), self.spec.head_dim)

    # --- writes ---------------------------------------------------------------------------------
    def write(self, layer, k, v, slots, positions=None) -> None:
        """``v`` is ``k``'s first ``value_dim`` channels (the model's view of one row): only ``k`` is coded."""
        self.row.store(k, slots, self.flat_fields[layer])

    def write_prefix(self, table: TableHandle, layer, k, v, slots) -> None:
        self.row.store(k, slots, self.flat_fields[layer])

    # --- moves ----------------------------------------------------------------------------------
    def copy_pages(self, src, dst) -> None:
        for t in self.fields.values():
            t[:, dst] = t[:, src]

    def gather_kept(self, layer, table, old_slots, keep):
        """The kept slots' fields, moved exactly by ``scatter_kept`` (the codes are token-local)."""
        return self.gather_fields(layer, old_slots[keep])

    def scatter_kept(self, layer, table, kept, new_slots) -> None:
        for name, value in kept.items():
            self.flat_fields[layer][name].index_copy_(0, new_slots[: value.shape[0]], value)

    # --- reads ----------------------------------------------------------------------------------
    def layer_kv(self, layer: int) -> tuple[DecodedRows, DecodedRows]:
        """``DecodedRows`` readers (decoded on indexing): the rows, and their first ``value_dim`` channels."""
        return DecodedRows(self, layer, self.spec.head_dim), DecodedRows(self, layer, self.spec.value_dim)

    def view(self, common, tables, num_new_tokens, layer) -> QuantizedLatentView:
        common = dict(common, codec=self.codec, row_codec=self.row, value_dim=self.spec.value_dim,
                      quant_lens=common["kv_lens"], quant_lens_cpu=common["kv_lens_cpu"])
        return self._layer_view(common, layer)

    def layer_view(self, view: QuantizedLatentView, layer: int) -> QuantizedLatentView:
        common = {f.name: getattr(view, f.name) for f in dataclass_fields(QuantizedLatentView)
                  if f.name not in ("k_fields", "v_fields", "layer")}
        return self._layer_view(common, layer)

    def _layer_view(self, common: dict, layer: int) -> QuantizedLatentView:
        fields = self.per_layer_fields[layer]
        return QuantizedLatentView(**common, layer=layer, k_fields=fields, v_fields=fields)
