"""The decode roofline's MoE byte count: distinct routed experts per layer, measured by the engine."""

import random

import pytest

from engine import LLM
from engine.models.moe import SparseMoeBlock
from benchmarks.roofline import measure_routed_experts


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_measured_routed_experts_equal_the_routes_taken(tiny_dirs, decode_steps):
    """Per decode forward pass, also when one engine step runs several (``decode_steps``)."""
    llm = LLM(tiny_dirs["qwen3_moe"], dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=256,
              decode_steps=decode_steps)
    engine = llm.engine
    rng = random.Random(0)
    requests = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(3)]
    distinct = []
    for block in [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]:
        route = block.route

        def recording(x, router_logits=None, route=route):
            ids, weights = route(x, router_logits)
            if x.shape[0] == len(requests):  # decode steps: one token per request
                distinct.append(len(set(ids.flatten().tolist())))
            return ids, weights

        block.route = recording
    got = measure_routed_experts(engine, requests, steps=5)
    assert len(distinct) >= 5 * engine.model_config.num_layers
    assert abs(got - sum(distinct) / len(distinct)) < 1e-9
    assert not engine.has_unfinished()
