"""Zeroed storage for KV pools: resident memory follows the pages written, not the budget, on the CPU."""

from __future__ import annotations

import math

import numpy
import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``, except on the CPU, where the bytes come from numpy's ``calloc``: a large block is
    mapped from the OS already zeroed and each page becomes resident only when first written, so an engine
    whose KV budget is 512 MiB holds only what its requests have stored (torch's CPU allocator writes every
    byte of ``torch.zeros`` up front)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(numpy.zeros(nbytes, dtype=numpy.uint8)).view(dtype).view(shape)
