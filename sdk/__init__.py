"""Python SDK of the agentrt server: ``Client`` / ``AsyncClient``, ``Chain`` handles, typed errors, an agent loop.

The wire types are ``sdk.schema`` (shared with the server). Names load lazily, so the server's
``import sdk.schema`` does not pull in httpx or websockets."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "tool_result": "sdk._base",
    "Agent": "sdk.agent", "Transcript": "sdk.agent",
    "AsyncChain": "sdk.async_client", "AsyncChains": "sdk.async_client", "AsyncClient": "sdk.async_client",
    "Chain": "sdk.client", "Chains": "sdk.client", "Client": "sdk.client",
    **{n: "sdk.errors" for n in ("AgentrtConnectionError", "AgentrtError", "AuthError", "Conflict", "Invalid",
                                 "NotFound", "Overloaded")},
    **{n: "sdk.schema" for n in ("AssistantMessage", "ChainList", "ChainRead", "ChainSummary", "PruneEvent",
                                 "PrunePolicy", "PruneResult", "Region", "Sampling", "Tool", "ToolCall",
                                 "ToolResultMessage", "TurnDelta", "TurnResult", "Usage", "UserMessage")},
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
