"""Method slots: a chain may run a method configuration other than the server's, and each such configuration
holds one of the engine's ``max_methods`` slots (``retain_method``) from its first chain until its last is
deleted. This counts the chains of each configuration, per tenant too (``max_method_configs_per_tenant``), and
takes configurations on and gives them back in the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from agentrt.config import ServerConfig
from agentrt.engine_worker import EngineUnavailable, EngineWorker
from agentrt.errors import TooManyMethodConfigs, bad_field
from engine.errors import ConfigError
from engine.registry import METHODS, create_method

if TYPE_CHECKING:
    from engine.engine_handle import EngineHandle

log = logging.getLogger(__name__)
T = TypeVar("T")
MethodKey = tuple[str, str]  # (method, its config as canonical JSON)


def method_key(method: str, config: dict[str, Any]) -> MethodKey:
    return method, msgspec.json.encode(config, order="sorted").decode()


class MethodSlots:
    def __init__(self, config: ServerConfig, worker: EngineWorker):
        self.config = config
        self.worker = worker
        self.chains: dict[MethodKey, int] = {}  # configurations other than the server's: their chains
        self.tenant_methods: dict[str, dict[MethodKey, int]] = {}
        self.retained: set[MethodKey] = set()  # those the engine holds for the chains now

    def default(self) -> tuple[str, dict]:
        engine = self.worker.engine
        return engine.method.name, dict(engine.config.method_config)

    def chain_method(self, method: str | None, config: dict | None) -> tuple[str, dict]:
        """The (method, config) a new chain runs: the server's unless the request names its own, whose knobs
        are checked here (400 naming the field at fault); the engine takes it on in ``take``."""
        default = self.default()
        if method is None and config is None:
            return default
        name = default[0] if method is None else method
        options = dict(config) if config is not None else (default[1] if name == default[0] else {})
        try:
            METHODS.get(name)
        except ConfigError as exc:
            raise bad_field("method", str(exc)) from None
        try:
            create_method(name, options)
        except ConfigError as exc:
            raise bad_field("method_config" if config is not None else "method", str(exc)) from None
        return name, options

    def is_default(self, key: MethodKey) -> bool:
        return key == method_key(*self.default())

    def count(self, tenant: str, key: MethodKey, delta: int) -> None:
        if self.is_default(key):
            return
        mine = self.tenant_methods.setdefault(tenant, {})
        for counts in (self.chains, mine):
            counts[key] = counts.get(key, 0) + delta
            if counts[key] <= 0:
                del counts[key]
        if not mine:
            del self.tenant_methods[tenant]

    async def take(self, tenant: str, key: MethodKey, field: str) -> None:
        """Call holding ``ChainService.creating``, for a new chain of ``tenant`` with ``key``: 429 when it is a new
        configuration for the tenant beyond its limit; the engine takes it on if no chain uses it yet (400
        naming ``field`` when it cannot); then it counts the chain."""
        if self.is_default(key):
            return
        mine = self.tenant_methods.get(tenant, {})
        limit = self.config.max_method_configs_per_tenant
        if key not in mine and limit is not None and len(mine) >= limit:
            raise TooManyMethodConfigs(tenant, limit)
        if key not in self.retained:
            try:
                await self.retain(key)
            except ConfigError as exc:
                raise bad_field(field, str(exc)) from None
        self.count(tenant, key, +1)

    async def give_back(self, tenant: str, key: MethodKey) -> None:
        """A chain of ``tenant`` with ``key`` is gone: the engine releases the configuration with its last
        chain (it stays taken on while a request still runs it)."""
        if self.is_default(key):
            return
        self.count(tenant, key, -1)
        if key in self.chains or key not in self.retained:
            return
        self.retained.discard(key)
        name, config = key[0], msgspec.json.decode(key[1])
        try:
            await self.engine_now(lambda e: e.release_method(name, config))
        except Exception:  # the chain is deleted whatever the engine says
            log.exception("releasing method %s %s failed", name, key[1])

    async def retain(self, key: MethodKey) -> None:
        """The engine takes ``key`` on and holds it (ConfigError when it cannot)."""
        name, config = key[0], msgspec.json.decode(key[1])
        await self.engine_now(lambda e: e.retain_method(name, config))
        if key in self.retained:  # retained meanwhile by a concurrent request: one hold is enough
            await self.engine_now(lambda e: e.release_method(name, config))
        self.retained.add(key)

    async def engine_now(self, fn: Callable[[EngineHandle], T]) -> T:
        """``fn(engine)`` on the worker thread, or here when the worker has not started (at ``ChainService.start``, when
        nothing else touches the engine)."""
        try:
            return await self.worker.call(fn)
        except EngineUnavailable:  # raised only while the worker thread is not running
            return fn(self.worker.engine)
