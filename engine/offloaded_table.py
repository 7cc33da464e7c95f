"""A chain table off the device, as the chain tiers keep it: where it is (host memory, a file on disk, or
dropped), its layout, and its bytes. It is its own module because two others read it: the tiers that move it
(``engine.chain_tiers``) and the file format that writes and reads it (``engine.chain_files``), which must not
import the tiers."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HOST, DISK, DROPPED = "host", "disk", "dropped"


@dataclass(slots=True, eq=False)
class OffloadedTable:
    """A chain table off the device: where it is, its layout, and its bytes (host tensors, or a file)."""

    chain_id: str
    num_pages: int
    num_slots: int
    layer_lens: list[int] | None
    kept_positions: list[torch.Tensor] | None
    compacted_at: int
    nbytes: int
    where: str = HOST
    pages: list[torch.Tensor] = field(default_factory=list)  # per storage tensor, its pages (host)
    state: list[torch.Tensor] = field(default_factory=list)  # a storage's per-table state (host)
    state_type: Any = None
    path: Path | None = None
    info: dict[str, Any] | None = None  # what a restart needs to adopt the chain (tokens, method); see ``restore``
    writing: Future | None = None  # its file's write, while in flight (the host tensors are kept until it ends)
    cancelled: bool = False  # dropped or loaded while its file was being written: the file goes when written
    # the chain's method state (``engine.state_tree``): skeleton (None: no state) and host tensors; after a load,
    # ``method_state`` holds it again on the device. ``method_state_lost``: the method kept state no file can hold
    # (a restart must not adopt the chain without it)
    method_tree: Any = None
    method_tensors: list[torch.Tensor] = field(default_factory=list)
    method_state: Any = None
    method_state_lost: bool = False
