"""Server configuration: what `agentrt serve` builds from its flags, and what tests pass to create_app."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.tiny_checkpoint import embedded_model_dir  # noqa: F401  (the server's default model)


def default_db_url() -> str:
    base = Path(os.environ.get("AGENTRT_CACHE") or Path.home() / ".cache" / "agentrt")
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite+aiosqlite:///{base / 'server.db'}"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from outside


class ConfigurationError(ValueError):
    """A server configuration the server refuses to run with (the message says why and what to do)."""


@dataclass(slots=True)
class ServerConfig:
    model: str | Path | None = None  # None: the embedded trained tiny model (embedded_model_dir)
    model_name: str | None = None  # the name clients use (default: the model directory's name)
    db_url: str | None = None  # SQLAlchemy async URL; None: a SQLite file under ~/.cache/agentrt
    method: str = "dense"
    method_config: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)  # further EngineConfig fields
    default_system_prompt: str = "You are a helpful assistant."
    default_max_tokens: int = 256  # OpenAI route, when the request sets none
    # POST /v1/chat/completions without chain_id resumes the tenant's implicit chain holding the longest prefix
    # of the request's messages (agentrt.implicit_chains); False: a stateless engine request (prefix caching only)
    implicit_chains: bool = True
    max_tokens_per_turn: int = 4096
    # how the model spells tool calls (agentrt.tool_syntax: hermes, glm45, qwen3_coder, deepseek, kimi_k2); None:
    # the one its chat template shows
    tool_call_syntax: str | None = None
    # --- auth and limits (docs/server.md "Auth" and "Limits") ---
    host: str = "127.0.0.1"  # the bind address; without auth only a loopback address is allowed
    require_auth: bool | None = None  # None: required unless ``host`` is a loopback address
    max_body_size: int = 8 * 2**20  # bytes per request body (413 beyond)
    max_chains_per_tenant: int | None = 1000  # 429 on create / fork beyond; None: unlimited
    max_queue_depth: int | None = 256  # engine requests in flight; a new one beyond -> 503 with Retry-After
    retry_after_s: int = 2
    # distinct (method, method_config) pairs other than the server's that one tenant's chains may use at once
    # (429 on create beyond): each holds one of the engine's max_methods slots while a chain uses it
    max_method_configs_per_tenant: int | None = 4
    # chat rendering and tokenization run on this many threads, off the event loop (agentrt.render_pool)
    render_workers: int = 2
    # a turn's messages and tools, as JSON, may hold this many characters per token of the model's context
    # (413 beyond, before any rendering): more cannot fit the context whatever the tokenizer makes of them
    max_chars_per_token: int = 32
    # the names a keyless loopback server answers to in ``Host`` (agentrt.host_guard); None: localhost and
    # loopback addresses when auth is off, any name when it is on; ("*",): any name
    allowed_hosts: tuple[str, ...] | None = None

    @property
    def host_allow_list(self) -> tuple[str, ...] | None:
        """The ``Host`` names to admit, or None for any."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else self.allowed_hosts
        return None if self.auth_required else ("localhost", "127.0.0.1", "::1")

    @property
    def auth_required(self) -> bool:
        return not is_loopback(self.host) if self.require_auth is None else self.require_auth

    def check(self) -> None:
        """Raise ConfigurationError for a configuration that must not serve."""
        if not self.auth_required and not is_loopback(self.host):
            raise ConfigurationError(
                f"refusing to serve without API keys on {self.host!r}, which is not a loopback address: "
                "bind to 127.0.0.1 for keyless local development, or enable auth and create a key with "
                "`agentrt keys create --tenant NAME`")
        for name in ("max_body_size", "max_tokens_per_turn", "retry_after_s", "render_workers", "max_chars_per_token"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be >= 1")
        for name in ("max_chains_per_tenant", "max_queue_depth", "max_method_configs_per_tenant"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigurationError(f"{name} must be >= 0 (or None for no limit)")
        if self.tool_call_syntax is not None:
            from agentrt.tool_syntax import SYNTAXES

            if self.tool_call_syntax not in SYNTAXES:
                raise ConfigurationError(f"tool_call_syntax {self.tool_call_syntax!r} is none of {', '.join(SYNTAXES)}")
