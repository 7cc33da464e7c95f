"""The methods one engine serves: its configured method and any a request names.

One instance per (name, config): requests that ask for the same knobs share it (a method keeps per-request
state keyed by request id, so sharing is what single-method engines do already). A method taken on per
request must run on the engine's cache and backend: it may not bring a cache layout of its own
(``make_cache``), and it must compose with the engine's KV storage and be readable by its backend; each of
those is checked once, when the method is first asked for, and fails with ConfigError.

Requests of different methods never share prefix-cache pages: each method's pages are keyed under a
namespace of its own (``prefix_namespace``), because what a method derives from written KV (page
metadata, scores) exists only for the pages its own requests wrote.

A configuration taken on through ``retain`` (what a server does for the chains that name it) is held: by
each retain until its ``release``, and by each request that runs it. When the last hold goes, the
configuration is forgotten and its slot is free for another; a later request for the same knobs takes on a
new instance under a new prefix namespace (the old one's pages carry no metadata for it). A configuration
taken on by a request or ``resolve`` alone, never retained, stays for the engine's life.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from hashlib import blake2b

from engine.attention_backend import TorchReferenceBackend
from engine.contract.cache import CacheManager, CacheSpec
from engine.contract.codec import KVCodec, check_composes
from engine.contract.method import SparseMethod
from engine.errors import ConfigError
from engine.registry import create_method


def method_key(method: SparseMethod) -> tuple[str, str]:
    return method.name, repr(method.config)


def take_on(method: SparseMethod, codec: KVCodec | None, backend: TorchReferenceBackend, spec: CacheSpec,
            cache: CacheManager) -> None:
    """An engine's ``MethodSet`` check: ``method`` (named by a request) composes with the engine's KV storage
    ``codec``, its views are readable by the engine's ``backend`` and its knobs fit the model (ConfigError if
    not); it is then handed the engine's ``cache``."""
    if codec is not None:
        check_composes(codec, method.name, method.view_types)
    reasons = backend.unsupported(method, spec.dtype, codec, spec.head_dim, spec.v_head_dim)
    if reasons:
        raise ConfigError(f"method {method.name!r} cannot run on attention backend {backend.name!r}: "
                          + "; ".join(reasons))
    method.validate(spec)
    method.bind(cache)


class MethodSet:
    def __init__(self, default: SparseMethod, check: Callable[[SparseMethod], None], max_methods: int = 8):
        """``check(method)`` raises ConfigError when the engine cannot serve ``method`` (backend, storage,
        model shape); it runs once per new configuration. At most ``max_methods`` configurations are taken
        on at once (some hold per-page metadata worth a fraction of the KV memory), so clients cannot grow
        the set without bound."""
        self.default = default
        self._check = check
        self.max_methods = max_methods
        self._by_key: dict[tuple[str, str], SparseMethod] = {method_key(default): default}
        self._namespace: dict[int, bytes | None] = {id(default): None}  # the default's keys stay as they were
        self._holds: dict[tuple[str, str], int] = {}  # retained configurations: retains + requests running them
        self._taken_on = itertools.count()  # a configuration taken on again gets a namespace of its own

    def resolve(self, name: str | None, options: dict | None = None) -> SparseMethod:
        """The instance serving ``name`` with ``options`` (None: the engine's method)."""
        return self._resolve(name, options)[0]

    def _resolve(self, name: str | None, options: dict | None) -> tuple[SparseMethod, bool]:
        """(the instance, whether it was taken on by this call)."""
        if name is None:
            if options:
                raise ConfigError("method_config was given without a method")
            return self.default, False
        method = create_method(name, options)
        key = method_key(method)
        known = self._by_key.get(key)
        if known is not None:
            return known, False
        if len(self._by_key) >= self.max_methods:
            raise ConfigError(f"this engine already serves {len(self._by_key)} method configurations "
                              f"(max_methods); use one of them or raise max_methods")
        if type(method).make_cache is not type(self.default).make_cache:
            raise ConfigError(f"method {name!r} builds its own cache layout, so it can only be the engine's "
                              f"configured method (this engine runs {self.default.name!r})")
        self._check(method)
        self._by_key[key] = method
        self._namespace[id(method)] = blake2b(repr((key, next(self._taken_on))).encode(), digest_size=16).digest()
        return method, True

    def retain(self, name: str | None, options: dict | None = None) -> SparseMethod:
        """``resolve``, and hold the configuration until ``release`` with the same name and options. One
        taken on before without retain stays for the engine's life anyway (retain and release change nothing)."""
        method, new = self._resolve(name, options)
        key = method_key(method)
        if new or key in self._holds:
            self._holds[key] = self._holds.get(key, 0) + 1
        return method

    def release(self, name: str | None, options: dict | None = None) -> None:
        """Undo one ``retain``: the configuration goes when nothing holds it any more."""
        if name is None:
            return
        known = self._by_key.get(method_key(create_method(name, options)))
        if known is not None:
            self.drop(known)

    def hold(self, method: SparseMethod) -> None:
        """A request runs ``method``: a retained configuration stays while it does."""
        key = method_key(method)
        if key in self._holds and self._by_key.get(key) is method:
            self._holds[key] += 1

    def drop(self, method: SparseMethod) -> None:
        """One hold on ``method`` ends: a request that ran it is gone, or a release."""
        key = method_key(method)
        if key not in self._holds or self._by_key.get(key) is not method:
            return
        self._holds[key] -= 1
        if self._holds[key] == 0:
            del self._holds[key], self._by_key[key], self._namespace[id(method)]

    def __contains__(self, method: SparseMethod) -> bool:
        return self._by_key.get(method_key(method)) is method

    def prefix_namespace(self, method: SparseMethod) -> bytes | None:
        return self._namespace[id(method)]

    def __iter__(self):
        return iter(self._by_key.values())
