"""KV storages (``engine.contract.storage.KVStorage``), chosen by the type of the cache spec.

A new representation registers its storage for its own ``CacheSpec`` subclass (whose ``bytes_per_page``
sizes the pool): ``register_storage(MySpec)(MyStorage)``, in its own module imported below.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.contract.cache import CacheSpec
from engine.contract.codec import CodedCacheSpec
from engine.contract.storage import KVStorage
from engine.storage.coded import CodedStorage
from engine.storage.dense import DenseKV

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

__all__ = ["CodedStorage", "DenseKV", "KVStorage", "make_storage", "register_storage"]
