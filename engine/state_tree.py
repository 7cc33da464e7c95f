"""A method's per-chain state (``SparseMethod.export_state``) as tensors plus a JSON skeleton, so the chain tiers
can write it into a chain's file beside its KV and a restarted engine can hand it back (``import_state``).

The state may nest dicts (string keys), lists and tuples of tensors and JSON scalars (accumulated attention
scores and their positions, stashed window queries); anything else (an object of a method's own) cannot be
written, and ``flatten`` raises ``TypeError`` naming it. No pickle: a chain file is data, never code.
"""

from __future__ import annotations

from typing import Any

import torch


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): the skeleton is JSON-able and refers to ``tensors`` by index."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {"t": len(tensors) - 1}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError("a method state's dict keys must be strings")
            return {"d": {k: walk(v) for k, v in x.items()}}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "u": [walk(v) for v in x]}
        raise TypeError(f"a method state holding a {type(x).__name__} cannot be written to a chain file")

    return walk(state), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor], device: torch.device | str | None = None) -> Any:
    """The state ``flatten`` took apart, its tensors moved to ``device`` (when given)."""

    def walk(node: dict) -> Any:
        (kind, value), = node.items()
        if kind == "t":
            t = tensors[value]
            return t if device is None else t.to(device)
        if kind == "v":
            return value
        if kind == "d":
            return {k: walk(v) for k, v in value.items()}
        if kind in ("l", "u"):
            items = [walk(v) for v in value]
            return items if kind == "l" else tuple(items)
        raise ValueError(f"unknown method-state node {kind!r}")

    return walk(skeleton)
