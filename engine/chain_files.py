"""A chain's file in the disk tier: one safetensors file per chain, so a chain survives its host copy and a restart,
and another engine can take it over.

The file holds the table's pages (one tensor per storage tensor), a storage's per-table state, a compacted table's
kept positions and the chain's method state; its header holds the layout, what a restart needs to adopt the chain
(``info``), and a digest of every tensor's bytes. It is written under a temporary name and renamed when complete,
and read only when its digest and layout match, so a partial or corrupted file is never loaded (the caller
recomputes the chain). Its name derives from the chain id alone (``chain_file_name``), the same in every engine.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.offloaded_table import DISK, OffloadedTable

TMP_SUFFIX = ".tmp"


def chain_file_name(chain_id: str) -> str:
    """The disk tier's file of a chain (the same in every engine, so another can find a chain it hands off)."""
    return f"{hashlib.sha256(chain_id.encode()).hexdigest()[:32]}.safetensors"


def file_chain_id(path: Path) -> str | None:
    """The chain a chain file holds (None for a file that is missing or unreadable)."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return json.loads((f.metadata() or {})["layout"])["chain"]
    except (OSError, SafetensorError, ValueError, KeyError):
        return None


def file_bytes(entry: OffloadedTable) -> int:
    """The size of an entry's file (what reading it reads)."""
    return entry.path.stat().st_size


def remove_partial_files(disk_dir: Path) -> None:
    """Remove the files a write cut short by a crash left under their temporary name."""
    for stale in disk_dir.glob(f"*{TMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


# --- writing ------------------------------------------------------------------------------------------------
def file_contents(entry: OffloadedTable) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An entry's host tensors and header metadata, as its file holds them (the digest is added when written)."""
    tensors = {f"page{i}": p.contiguous() for i, p in enumerate(entry.pages)}
    tensors |= {f"state{i}": s.contiguous() for i, s in enumerate(entry.state)}
    tensors |= {f"kept{i}": k.contiguous() for i, k in enumerate(entry.kept_positions or [])}
    tensors |= {f"mstate{i}": t.contiguous() for i, t in enumerate(entry.method_tensors)}
    state_type = None if entry.state_type is None else f"{entry.state_type.__module__}:{entry.state_type.__qualname__}"
    metadata = {"layout": json.dumps(_layout(entry)), "info": json.dumps(entry.info),
                "state_type": json.dumps(state_type), "nbytes": str(entry.nbytes),
                "method_state": json.dumps(entry.method_tree),
                "method_state_lost": json.dumps(entry.method_state_lost)}
    return tensors, metadata


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
               save: Callable[..., Any] = save_file) -> float:
    """Write a chain file (on the writer thread) with ``save`` (safetensors' ``save_file``): under a temporary
    name, then renamed; returns the seconds."""
    start = time.perf_counter()
    tmp = path.with_suffix(TMP_SUFFIX)
    try:
        save(tensors, str(tmp), metadata={"digest": _digest(tensors), **metadata})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return time.perf_counter() - start


# --- reading ------------------------------------------------------------------------------------------------
def read_file(entry: OffloadedTable, num_page_tensors: int) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                     list | None, list[torch.Tensor]]:
    """An entry's pages (``num_page_tensors``: its storage's tensors), state, kept positions (None for a table
    not compacted) and method state tensors, from its file; raises when the file is unreadable or its digest or
    layout does not match."""
    with safe_open(str(entry.path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if meta.get("digest") != _digest(tensors) or json.loads(meta.get("layout", "{}")) != _layout(entry):
        raise ValueError("its digest or layout does not match (a corrupted or foreign file)")
    pages = [tensors[f"page{i}"] for i in range(num_page_tensors)]
    state = [tensors[f"state{i}"] for i in range(sum(1 for n in tensors if n.startswith("state")))]
    kept = None if entry.kept_positions is None else [
        tensors[f"kept{i}"] for i in range(sum(1 for n in tensors if n.startswith("kept")))]
    method_tensors = [tensors[f"mstate{i}"] for i in range(sum(1 for n in tensors if n.startswith("mstate")))]
    return pages, state, kept, method_tensors


@dataclass(slots=True)
class FileHeader:
    """What a chain file's header says: enough to account for it and adopt its chain, its bytes unread."""

    layout: dict[str, Any]
    info: Any  # None: the file lacks what a restart needs
    state_type: str | None  # ``module:QualName`` of a storage's per-table state
    method_tree: Any
    method_state_lost: Any  # true: the chain's method kept state no file can hold
    nbytes: int

    @property
    def chain_id(self) -> str:
        return self.layout["chain"]

    def entry(self, path: Path) -> OffloadedTable:
        """The disk entry of the file at ``path`` (its bytes checked when loaded)."""
        layout = self.layout
        return OffloadedTable(layout["chain"], layout["pages"], layout["slots"], layout["layer_lens"],
                              None if layout["layer_lens"] is None else [], layout["compacted_at"], self.nbytes,
                              where=DISK, path=path, info=self.info, state_type=_import(self.state_type),
                              method_tree=self.method_tree)


def read_header(path: Path) -> FileHeader:
    """A chain file's header; raises (OSError, SafetensorError, ValueError, KeyError) when it is unreadable."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
    return FileHeader(json.loads(meta["layout"]), json.loads(meta.get("info", "null")),
                      json.loads(meta.get("state_type", "null")), json.loads(meta.get("method_state", "null")),
                      json.loads(meta.get("method_state_lost", "false")), int(meta["nbytes"]))


# --- handing over -------------------------------------------------------------------------------------------
def claim_file(path: Path, disk_dir: Path) -> Path | None:
    """Move the chain file at ``path`` into ``disk_dir`` (its path there), which claims it: of two engines racing
    for it, one gets it and the other None."""
    target = disk_dir / path.name
    try:
        os.replace(path, target)  # atomic on one file system: the claim
    except FileNotFoundError:
        return None
    except OSError:  # another file system: copy under a temporary name, then claim by removing the source
        tmp = target.with_suffix(TMP_SUFFIX)
        try:
            shutil.copyfile(path, tmp)
            path.unlink()
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, target)
    return target


def _import(qualified: str | None) -> Any:
    """A class from ``module:QualName`` (a storage's per-table state type), None for None."""
    if qualified is None:
        return None
    module, _, name = qualified.partition(":")
    return getattr(importlib.import_module(module), name)


def _layout(entry: OffloadedTable) -> dict[str, Any]:
    return {"chain": entry.chain_id, "pages": entry.num_pages, "slots": entry.num_slots,
            "layer_lens": entry.layer_lens, "compacted_at": entry.compacted_at}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
