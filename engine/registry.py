"""Methods and scorers by name. The engine owns the registries; entries register themselves or arrive by
entry point.

Entry points in the groups ``agentrt.methods`` / ``agentrt.scorers`` (declared in pyproject.toml) are loaded
lazily the first time a name is not found, so the engine finds every installed one without importing
``policies``.
"""

from importlib.metadata import entry_points

from engine.contract.method import SparseMethod
from engine.contract.scorer import ImportanceScorer
from engine.errors import ConfigError

ENTRY_POINT_GROUP = "agentrt.methods"
SCORER_GROUP = "agentrt.scorers"

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


_scorers: dict[str, type[ImportanceScorer]] = {}
_scorer_entry_points_loaded = False


def register_scorer(cls: type[ImportanceScorer]) -> type[ImportanceScorer]:
    existing = _scorers.get(cls.name)
    if existing is not None and existing is not cls:
        raise ConfigError(f"scorer name {cls.name!r} is already registered by {existing.__qualname__}")
    _scorers[cls.name] = cls
    return cls


def create_scorer(name: str) -> ImportanceScorer:
    global _scorer_entry_points_loaded
    if name not in _scorers and not _scorer_entry_points_loaded:
        _scorer_entry_points_loaded = True
        for ep in entry_points(group=SCORER_GROUP):
            _scorers.setdefault(ep.name, ep.load())
    cls = _scorers.get(name)
    if cls is None:
        raise ConfigError(f"unknown scorer {name!r}; available: {sorted(_scorers)}")
    return cls()
