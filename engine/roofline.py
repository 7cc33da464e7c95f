"""Ceilings measured in the same run as the figures compared with them, and the decode roofline."""

from __future__ import annotations

import torch


def _time_cuda(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bw = 2 * nbytes / _time_cuda(lambda: y.copy_(x), 20)
    del x, y
    torch.cuda.empty_cache()
    return bw


def matmul_rate(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    rate = 2 * n**3 / _time_cuda(lambda: a @ b, 20)
    del a, b
    torch.cuda.empty_cache()
    return rate


def weight_bytes(model: torch.nn.Module, exclude_embedding: bool = True) -> int:
    """Bytes a decode step reads from weights (the input embedding is a gather, not a full read)."""
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embedding and "embed_tokens" in name and not getattr(model.config, "tie_word_embeddings", False):
            continue
        total += p.numel() * p.element_size()
    return total


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of routed-expert weights (stacked ``mlp.experts`` parameters)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)


def expected_expert_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """Expected fraction of a layer's experts that ``batch`` tokens route to, under uniform routing
    (random weights route close to uniformly): 1 - (1 - k/E)^B."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch
