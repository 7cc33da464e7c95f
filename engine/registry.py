"""Methods by name. The engine owns the registry; methods register themselves or arrive by entry point.

Entry points in the group ``agentrt.methods`` (declared in pyproject.toml) are loaded lazily the first time a
name is not found, so the engine finds every installed method without importing ``policies``.
"""

from importlib.metadata import entry_points

from engine.contract.method import SparseMethod
from engine.errors import ConfigError

ENTRY_POINT_GROUP = "agentrt.methods"

_methods: dict[str, type[SparseMethod]] = {SparseMethod.name: SparseMethod}
_entry_points_loaded = False


def register_method(cls: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    existing = _methods.get(cls.name)
    if existing is not None and existing is not cls:
        raise ConfigError(f"method name {cls.name!r} is already registered by {existing.__qualname__}")
    _methods[cls.name] = cls
    return cls


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if ep.name not in _methods:
            _methods[ep.name] = cls


def available_methods() -> list[str]:
    _load_entry_points()
    return sorted(_methods)


def create_method(name: str, options: dict | None = None) -> SparseMethod:
    if name not in _methods:
        _load_entry_points()
    cls = _methods.get(name)
    if cls is None:
        raise ConfigError(f"unknown method {name!r}; available: {available_methods()}")
    return cls.from_options(options)
