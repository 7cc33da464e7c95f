"""A KV budget, as a fraction of the prompt, turned into each method's own knobs.

``budget`` is the fraction of the prompt's tokens a method may keep (eviction) or read (selection) per layer
and KV head; ``length`` is the prompt length it is sized for. ``dense`` ignores the budget.

Two knobs differ from the methods' defaults, for this 4-layer model (docs/quality.md has the numbers with the
defaults): SnapKV/PyramidKV pool votes with ``kernel_size=11`` (the question's queries vote for the fact's key;
the default 7 keeps too little of the 5-digit value after it), and OmniKV observes at layer 2 (layer 1's
attention does not yet find the fact).
"""

from __future__ import annotations

from typing import Any, Callable

STREAMING_SINK = 4


def _tokens(budget: float, length: int) -> int:
    return max(8, int(budget * length))


def _snapkv(b: int) -> dict[str, Any]:
    return {"budget": b, "window": min(32, b), "kernel_size": 11}


_KNOBS: dict[str, Callable[[int], dict[str, Any]]] = {
    "dense": lambda b: {},
    "streaming_llm": lambda b: {"sink_tokens": STREAMING_SINK, "window": max(1, b - STREAMING_SINK), "slack": 0},
    "snapkv": _snapkv,
    "pyramidkv": _snapkv,
    "h2o": lambda b: {"heavy_budget": b // 2, "recent_budget": b - b // 2},
    "tova": lambda b: {"budget": b},
    "knorm": lambda b: {"budget": b},
    "rkv": lambda b: {"budget": b, "alpha": min(8, b)},
    "quest": lambda b: {"token_budget": b, "dense_layers": 1},
    "omnikv": lambda b: {"token_budget": b, "observation_layers": (2,)},
}
METHODS = tuple(_KNOBS)


def method_config(method: str, budget: float, length: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The method's knobs for ``budget`` of a ``length``-token prompt; ``overrides`` replace individual knobs."""
    if method not in _KNOBS:
        raise ValueError(f"no budget mapping for method {method!r}; known: {', '.join(METHODS)}")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
    return {**_KNOBS[method](_tokens(budget, length)), **(overrides or {})}
