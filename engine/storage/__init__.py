"""KV storages (``engine.contract.storage.KVStorage``), chosen by the type of the cache spec.

A new representation registers its storage for its own ``CacheSpec`` subclass (whose ``bytes_per_page``
sizes the pool): ``register_storage(MySpec)(MyStorage)``, in its own module imported below.

Under a KV codec (``kv_storage``) the model's spec is replaced by its coded form: ``register_coded_spec(MySpec)``
names the function that builds it from the spec and the codec (dense keys and values: ``CodedCacheSpec``; latent
rows: ``CodedLatentCacheSpec``); a spec type without one cannot be coded (``coded_cache_spec`` returns None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.contract.cache import CacheSpec
from engine.contract.codec import CodedCacheSpec, KVCodec
from engine.contract.storage import KVStorage
from engine.storage.coded import CodedStorage
from engine.storage.coded_latent import CodedLatentCacheSpec, CodedLatentKV, coded_latent_spec
from engine.storage.dense import DenseKV
from engine.storage.latent import LatentCacheSpec, LatentKV
from engine.storage.recurrent import HybridCacheSpec, HybridKV

_STORAGE_BY_SPEC: dict[type[CacheSpec], type[KVStorage]] = {}


def register_storage(spec_type: type[CacheSpec]) -> Callable[[type[KVStorage]], type[KVStorage]]:
    def register(cls: type[KVStorage]) -> type[KVStorage]:
        _STORAGE_BY_SPEC[spec_type] = cls
        return cls

    return register


def make_storage(spec: CacheSpec, num_pages: int) -> KVStorage:
    """The storage registered for ``spec``'s type (or its nearest registered base) over ``num_pages`` pages."""
    for spec_type in type(spec).__mro__:
        cls = _STORAGE_BY_SPEC.get(spec_type)
        if cls is not None:
            return cls(spec, num_pages)
    raise TypeError(f"no KV storage registered for {type(spec).__name__}")


register_storage(CacheSpec)(DenseKV)
register_storage(CodedCacheSpec)(CodedStorage)
register_storage(LatentCacheSpec)(LatentKV)
register_storage(CodedLatentCacheSpec)(CodedLatentKV)
register_storage(HybridCacheSpec)(HybridKV)

CodedSpecBuilder = Callable[[CacheSpec, KVCodec, int], CacheSpec]
_CODED_SPEC_BY_SPEC: dict[type[CacheSpec], CodedSpecBuilder] = {}


def register_coded_spec(spec_type: type[CacheSpec]) -> Callable[[CodedSpecBuilder], CodedSpecBuilder]:
    """``build(spec, codec, max_running)`` gives the coded form of a ``spec_type`` spec (ConfigError where the codec
    cannot store it; ``max_running``: the running requests a codec's full-precision windows are kept for)."""
    def register(build: CodedSpecBuilder) -> CodedSpecBuilder:
        _CODED_SPEC_BY_SPEC[spec_type] = build
        return build

    return register


def coded_cache_spec(spec: CacheSpec, codec: KVCodec, max_running: int) -> CacheSpec | None:
    """``spec`` stored by ``codec``; None where no coded form of ``spec``'s type is registered. The type must match
    exactly: a subclass (a hybrid model's spec) holds state that a base type's coded form would not carry."""
    build = _CODED_SPEC_BY_SPEC.get(type(spec))
    return None if build is None else build(spec, codec, max_running)


@register_coded_spec(CacheSpec)
def coded_dense_spec(spec: CacheSpec, codec: KVCodec, max_running: int) -> CodedCacheSpec:
    codec.check(spec)
    return CodedCacheSpec(**{f: getattr(spec, f) for f in CacheSpec.__dataclass_fields__}, codec=codec,
                          max_windows=max_running if codec.has_window else 0)


register_coded_spec(LatentCacheSpec)(coded_latent_spec)


def model_cache_spec(model_config, world_size: int, dtype: torch.dtype, device: torch.device,
                     page_size: int, max_running: int = 0, prefix_checkpoints: int = 0) -> CacheSpec:
    """What one token's KV looks like for a model (``engine.model_config.ModelConfig``) on one tensor-parallel
    rank: its KV heads' share of dense keys and values; for latent attention, the one latent row every rank
    holds whole; for a hybrid model, its share of the dense KV of its full-attention layers plus a state slot per
    running request (``max_running`` of them) of its linear-attention heads, and ``prefix_checkpoints`` kept
    states for prefix reuse."""
    linear = getattr(model_config, "linear", None)
    if linear is not None:
        return HybridCacheSpec(num_layers=model_config.kv_layers, num_kv_heads=model_config.num_kv_heads // world_size,
                               head_dim=model_config.head_dim, dtype=dtype, device=device, page_size=page_size,
                               linear_layers=model_config.linear_layers,
                               conv_shape=linear.rank_conv_state_shape(world_size),
                               recurrent_shape=linear.rank_recurrent_state_shape(world_size),
                               state_dtype=getattr(torch, linear.recurrent_dtype), max_states=max_running,
                               prefix_checkpoints=prefix_checkpoints)
    if model_config.mla is not None:
        return LatentCacheSpec(num_layers=model_config.num_layers, num_kv_heads=1, head_dim=model_config.head_dim,
                               dtype=dtype, device=device, page_size=page_size, value_dim=model_config.value_dim)
    return CacheSpec(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads // world_size,
                     head_dim=model_config.head_dim, dtype=dtype, device=device, page_size=page_size)


__all__ = ["CodedLatentCacheSpec", "CodedLatentKV", "CodedStorage", "DenseKV", "HybridCacheSpec", "HybridKV",
           "KVStorage", "LatentCacheSpec", "LatentKV", "coded_cache_spec", "make_storage", "model_cache_spec",
           "register_coded_spec", "register_storage"]
