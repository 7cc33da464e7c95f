"""A kernel launch that steps down to a smaller one where the GPU's shared memory cannot hold it.

The decode kernels' default launches were measured on Hopper, whose 227 KB of shared memory a block holds five
pipeline stages of 64-row latent tiles (~185 KB). An A100 holds 163 KB a block, an L40S or an RTX 4090 99 KB:
there Triton refuses the launch (``OutOfResources``, raised before anything runs on the device). ``launch_fitting``
then tries two stages, then row tiles halved down to 16, and remembers per GPU and launch what fitted, so a
later call (and a CUDA graph's capture) goes straight to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from triton.runtime.errors import OutOfResources

log = logging.getLogger(__name__)

# (device index, the caller's launch key, BLOCK_N, num_stages) -> the (BLOCK_N, num_stages) that fitted
_FITTED: dict[tuple, tuple[int, int]] = {}


def smaller_launches(block_n: int, num_stages: int, min_block_n: int = 16) -> Iterator[tuple[int, int]]:
    """(BLOCK_N, num_stages) from the launch asked for down: two stages, then the row tile halved."""
    yield block_n, num_stages
    if num_stages > 2:
        yield block_n, 2
    while block_n > min_block_n:
        block_n //= 2
        yield block_n, min(num_stages, 2)


def launch_fitting(launch: Callable[[int, int], None], device_index: int | None, key: tuple, block_n: int,
                   num_stages: int) -> tuple[int, int]:
    """Call ``launch(block_n, num_stages)``; where it raises ``OutOfResources`` for shared memory, the next of
    ``smaller_launches``. Returns the (BLOCK_N, num_stages) that ran; raises the last refusal if none fits."""
    cache_key = (device_index, key, block_n, num_stages)
    fitted = _FITTED.get(cache_key)
    tries = [fitted] if fitted is not None else list(smaller_launches(block_n, num_stages))
    for i, (bn, stages) in enumerate(tries):
        try:
            launch(bn, stages)
        except OutOfResources as exc:
            if "shared memory" not in str(exc) or i == len(tries) - 1:
                raise
            continue
        if fitted is None:
            _FITTED[cache_key] = (bn, stages)
            if (bn, stages) != (block_n, num_stages):
                log.info("launch %s of %d rows in %d stages exceeds this GPU's shared memory: %d rows in %d stages",
                         key, block_n, num_stages, bn, stages)
        return bn, stages
    raise AssertionError("unreachable: smaller_launches yields at least the launch asked for")
