"""Typed configs from user-supplied knobs (methods, KV storage codecs): unknown knobs and bad values are
ConfigErrors that name what was being configured."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from engine.errors import ConfigError


def build_config(config_cls: type, options: dict[str, Any] | None, what: str) -> Any:
    """``config_cls(**options)``; ``what`` names the owner in errors (the kind and registered name)."""
    options = dict(options or {})
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{what} has no option(s) {unknown}; known options: {sorted(known) or 'none'}")
    try:
        return config_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {exc}") from exc
