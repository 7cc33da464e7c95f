"""Ceilings measured in the same run as the figures compared with them, the cards' spec bandwidths, and the
decode roofline."""

from __future__ import annotations

import torch


# HBM bandwidth from the vendor's data sheet, bytes per second, by a substring of torch.cuda.get_device_name
# (first match wins, so the more specific names come first). The copy rate a run measures (read + write bytes
# of a device-to-device copy) is what a kernel can reach in practice; the spec rate is what the card is sold
# at, the ceiling readers compare with other engines' figures.
SPEC_BANDWIDTH: tuple[tuple[str, float | None], ...] = (
    ("GH200", None),  # HBM3 or HBM3e by variant: not told apart by the name
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5 80GB ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # the 40GB cards, SXM4 and PCIe
    ("B200", 8.0e12),
    ("L40", 0.864e12),  # L40 and L40S
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12),
)


def spec_bandwidth(device_name: str | None) -> float | None:
    """The data-sheet memory bandwidth of a GPU by its name (bytes/s); None for a CPU or a card not listed."""
    if not device_name:
        return None
    return next((bw for key, bw in SPEC_BANDWIDTH if key in device_name), None)


def lm_head_params(model: torch.nn.Module) -> int:
    """Parameters of the output projection (vocab x hidden, tied to the embedding or not)."""
    head = getattr(model, "lm_head", None)
    return head.weight.numel() if head is not None else 0


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
    """Bytes of routed-expert weights (stacked ``mlp.experts`` parameters; a shared expert stacked after the routed
    ones is read every step and not counted here)."""
    from engine.models.moe import StackedExperts

    return sum(p.numel() * p.element_size() * m.num_routed // m.num_experts
               for m in model.modules() if isinstance(m, StackedExperts) for p in m.parameters())


def expected_expert_fraction(num_experts: int, top_k: int, batch: int) -> float:
    """Expected fraction of a layer's experts that ``batch`` tokens route to, under uniform routing
    (random weights route close to uniformly): 1 - (1 - k/E)^B."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def measure_routed_experts(engine, requests: list[list[int]], steps: int) -> float:
    """Mean over eager decode forward passes of the distinct routed experts per MoE layer, for ``requests``
    decoding together (each is prefilled first). Returns experts per layer per forward pass."""
    from engine.models.moe import StackedExperts
    from engine.sampling_params import SamplingParams

    modules = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [engine.add_request(r, params) for r in requests]
    reqs = [engine._requests[i] for i in ids]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    counter = torch.zeros((), dtype=torch.float64, device=engine.device)
    passes = [0]  # forward passes, not engine steps: with decode_steps > 1 one step runs several
    hook = modules[0].register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1)) if modules else None
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: the counters run in Python
    try:
        for m in modules:
            m.routed_counter = counter
        while engine.has_unfinished() and passes[0] < steps:
            engine.step()
    finally:
        for m in modules:
            m.routed_counter = None
        if hook is not None:
            hook.remove()
        engine.runner.graphs = graphs
        for i in ids:
            if i in engine._requests:
                engine.abort(i)
    return counter.item() / max(passes[0], 1) / max(len(modules), 1)
