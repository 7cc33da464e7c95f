"""Which tensor-parallel rank this process is, of how many, and the collectives model code and methods use.

Every collective is the identity at world size 1. Model layers keep the group current when they were built;
methods reach the group of the engine whose step is running through the module-level helpers
(``all_reduce``, ``all_gather``, ``tp_rank``, ``tp_world_size``), which ``use_group`` sets for the call.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch

REDUCE_OPS = ("sum", "max", "mean")


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup when world_size > 1
    # every rank holds the same KV heads (a latent cache's one row) and a slice of their query heads, so a score
    # pooled over a KV head's query heads is pooled over the ranks too (``reduce_over_query_heads``)
    kv_heads_shared: bool = False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the ranks and return the result (in place when ``tensor`` is contiguous).
        ``mean`` assumes every rank reduced the same number of terms locally (each holds as many heads)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        if op == "mean":
            tensor /= self.world_size
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on each) along ``dim``, rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_ints(self, values: list[int], device: torch.device) -> list[int]:
        """Rank 0's ``values`` on every rank (each rank passes a list of the same length)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(t, src=0, group=self.group)
        return t.tolist()

    def shard(self, size: int) -> tuple[int, int]:
        """(offset, length) of this rank's equal part of ``size`` (divisibility checked by the caller)."""
        part = size // self.world_size
        return self.rank * part, part


SINGLE = TPGroup()
_current: TPGroup = SINGLE


def current_group() -> TPGroup:
    return _current


@contextmanager
def use_group(group: TPGroup) -> Iterator[TPGroup]:
    """Make ``group`` the one layers built and methods called inside the block reduce over."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce over the tensor-parallel ranks of the running engine; identity at world size 1."""
    return _current.all_reduce(tensor, op)


def all_gather(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenate the ranks' tensors along ``dim`` (rank order); identity at world size 1."""
    return _current.all_gather(tensor, dim)


def reduce_over_query_heads(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A per-KV-head score pooled (``op``) over that head's query heads, completed over the ranks: the identity
    where each rank holds whole KV heads with all their query heads, ``all_reduce`` where ranks split the query
    heads of shared KV heads (latent attention)."""
    return _current.all_reduce(tensor, op) if _current.kv_heads_shared else tensor


def query_head_ranks() -> int:
    """How many ranks hold query heads of each KV head: the world size where KV heads are shared, else 1."""
    return _current.world_size if _current.kv_heads_shared else 1


def tp_rank() -> int:
    return _current.rank


def tp_world_size() -> int:
    return _current.world_size


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: on CUDA the r-th GPU after the configured one; elsewhere the device itself."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_group(rank: int, world_size: int, port: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the ranks' default process group: NCCL on CUDA, gloo elsewhere (rank 0 listens on ``port``)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, dist.group.WORLD)


def destroy_group(group: TPGroup) -> None:
    import torch.distributed as dist

    if group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
