"""A kernel launch that steps down to a smaller one where the GPU's shared memory cannot hold it.

The kernels' default launches were measured on Hopper, whose 227 KB of shared memory a block holds, say, five
pipeline stages of 64-row latent tiles (~185 KB) or the fused decode linears' three stages of 256-deep weight
tiles (120 KB). An A100 holds 163 KB a block, an L40S, an RTX 4090 or an RTX 5090 99 KB: there Triton refuses
the launch (``OutOfResources``, raised before anything runs on the device). ``launch_fitting`` then tries two
stages, then the tile along the loop halved (down to ``min_tile``), and remembers per GPU and launch what
fitted, so a later call (and a CUDA graph's capture) goes straight to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from triton.runtime.errors import OutOfResources

log = logging.getLogger(__name__)

# (device index, the caller's launch key, tile, num_stages) -> the (tile, num_stages) that fitted
_FITTED: dict[tuple, tuple[int, int]] = {}


def smaller_launches(tile: int, num_stages: int, min_tile: int = 16) -> Iterator[tuple[int, int]]:
    """(tile, num_stages) from the launch asked for down: two stages, then the tile halved to ``min_tile``."""
    yield tile, num_stages
    if num_stages > 2:
        yield tile, 2
    while tile > min_tile:
        tile //= 2
        yield tile, min(num_stages, 2)


def launch_fitting(launch: Callable[[int, int], None], device_index: int | None, key: tuple, tile: int,
                   num_stages: int, min_tile: int = 16) -> tuple[int, int]:
    """Call ``launch(tile, num_stages)``; where it raises ``OutOfResources`` for shared memory, the next of
    ``smaller_launches``. Returns the (tile, num_stages) that ran; raises the last refusal if none fits."""
    cache_key = (device_index, key, tile, num_stages)
    fitted = _FITTED.get(cache_key)
    tries = [fitted] if fitted is not None else list(smaller_launches(tile, num_stages, min_tile))
    for i, (t, stages) in enumerate(tries):
        try:
            launch(t, stages)
        except OutOfResources as exc:
            if "shared memory" not in str(exc) or i == len(tries) - 1:
                raise
            continue
        if fitted is None:
            _FITTED[cache_key] = (t, stages)
            if (t, stages) != (tile, num_stages):
                log.info("launch %s (tile %d, %d stages) exceeds this GPU's shared memory: tile %d, %d stages",
                         key, tile, num_stages, t, stages)
        return t, stages
    raise AssertionError("unreachable: smaller_launches yields at least the launch asked for")
