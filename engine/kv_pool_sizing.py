"""How many KV pages an engine's pool holds: a function of the configuration, the cache spec and free memory.

The pool is sized once, after the weights are loaded: ``num_pages`` if set, else a byte budget
(``kv_cache_memory_bytes``; on a GPU ``gpu_memory_utilization`` of total memory minus what is already in use;
``DEFAULT_CPU_KV_BYTES`` on the CPU) divided by the spec's bytes per page. A codec's full-precision windows
(one per running sequence) come out of the same budget first.
"""

from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.contract.cache import CacheSpec
from engine.errors import OutOfPagesError


def kv_pool_pages(config: EngineConfig, spec: CacheSpec, device: torch.device) -> int:
    """Pages of ``spec`` the KV budget holds on ``device``; OutOfPagesError if not even one."""
    if config.num_pages is not None:
        return config.num_pages
    budget = config.kv_cache_memory_bytes
    if budget is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
    budget = budget if budget is not None else DEFAULT_CPU_KV_BYTES
    windows = spec.window_bytes  # a codec's full-precision windows share the budget
    budget -= windows
    num_pages = budget // spec.bytes_per_page
    if num_pages < 1:
        held = f" after {windows} bytes of kv_storage windows (max_num_seqs of them)" if windows else ""
        raise OutOfPagesError(
            f"KV budget of {budget} bytes{held} holds no page of {spec.bytes_per_page} bytes; on a GPU the "
            "budget is gpu_memory_utilization x total memory minus what is already in use (other engines "
            "included): lower it or set kv_cache_memory_bytes / num_pages"
        )
    return num_pages
