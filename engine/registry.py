"""Methods and scorers by name. The engine owns the registries; entries register themselves or arrive by
entry point.

Entry points in the groups ``agentrt.methods`` / ``agentrt.scorers`` (declared in pyproject.toml) are loaded
lazily the first time a name is not found, so the engine finds every installed one without importing
``policies``.
"""

from importlib.metadata import entry_points
from typing import Generic, TypeVar

from engine.contract.codec import KVCodec
from engine.contract.method import SparseMethod
from engine.contract.scorer import ImportanceScorer
from engine.errors import ConfigError

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    def __init__(self, kind: str, group: str, builtin: dict[str, T] | None = None):
        self.kind, self.group = kind, group
        self._entries: dict[str, T] = dict(builtin or {})
        self._entry_points_loaded = False

    def register(self, cls: T) -> T:
        """Class decorator: make ``cls`` available under ``cls.name``."""
        existing = self._entries.get(cls.name)
        if existing is not None and existing is not cls:
            raise ConfigError(f"{self.kind} name {cls.name!r} is already registered by {existing.__qualname__}")
        self._entries[cls.name] = cls
        return cls

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            if ep.name not in self._entries:
                self._entries[ep.name] = ep.load()

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        if name not in self._entries:
            self._load_entry_points()
        cls = self._entries.get(name)
        if cls is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; available: {self.names()}")
        return cls


METHODS: Registry[type[SparseMethod]] = Registry("method", "agentrt.methods", {SparseMethod.name: SparseMethod})
SCORERS: Registry[type[ImportanceScorer]] = Registry("scorer", "agentrt.scorers")
KV_STORAGE: Registry[type[KVCodec]] = Registry("kv_storage", "agentrt.kv_storage")
register_kv_storage = KV_STORAGE.register

register_method = METHODS.register
register_scorer = SCORERS.register
available_methods = METHODS.names


def create_method(name: str, options: dict | None = None) -> SparseMethod:
    return METHODS.get(name).from_options(options)


def create_kv_storage(name: str, options: dict | None = None) -> KVCodec:
    return KV_STORAGE.get(name).from_options(options)


def create_scorer(name: str) -> ImportanceScorer:
    return SCORERS.get(name)()
