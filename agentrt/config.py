"""Server configuration: what `agentrt serve` builds from its flags, and what tests pass to create_app."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def default_db_url() -> str:
    base = Path(os.environ.get("AGENTRT_CACHE") or Path.home() / ".cache" / "agentrt")
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{base / 'server.db'}"


@dataclass(slots=True)
class ServerConfig:
    model: str | Path | None = None  # None: the embedded tiny model (engine.tiny_checkpoint.default_model_dir)
    model_name: str | None = None  # the name clients use (default: the model directory's name)
    db_url: str | None = None  # SQLAlchemy async URL; None: a SQLite file under ~/.cache/agentrt
    method: str = "dense"
    method_config: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)  # further EngineConfig fields
    default_system_prompt: str = "You are a helpful assistant."
    default_max_tokens: int = 256  # OpenAI route, when the request sets none
    max_tokens_per_turn: int = 4096
