"""KV storages (``engine.contract.storage.KVStorage``), chosen by the type of the cache spec.

A new representation registers its storage for its own ``CacheSpec`` subclass (whose ``bytes_per_page``
sizes the pool): ``register_storage(MySpec)(MyStorage)``, in its own module imported below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.contract.cache import CacheSpec
from engine.contract.codec import CodedCacheSpec
from engine.contract.storage import KVStorage
from engine.storage.coded import CodedStorage
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
register_storage(HybridCacheSpec)(HybridKV)


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


__all__ = ["CodedStorage", "DenseKV", "HybridCacheSpec", "HybridKV", "KVStorage", "LatentCacheSpec", "LatentKV",
           "make_storage",
           "model_cache_spec", "register_storage"]
