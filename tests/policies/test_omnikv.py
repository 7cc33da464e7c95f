"""OmniKV against a reference written from its paper's definition.

The reference is ``tests/selection_reference.py``'s (its module docstring says how) with the method's rule applied
from its definition: the engine's selections, its tokens and masked greedy tokens must agree.
"""

import pytest
import torch

import policies.omnikv  # noqa: F401  (registers "omnikv")
from engine import LLM
from tests.selection_reference import GREEDY, PAGE, capture_selections, check_against_reference, make_prompts
from tests.selection_reference import model_dir, selection_dirs  # noqa: F401 (fixtures)


# --- references from the papers' definitions ------------------------------------------------------------------
def omnikv_reference(observation_layers, budget):
    """OmniKV: an observation layer attends fully and ranks every slot by its attention probability summed over
    query heads; the newest token plus the top budget - 1 others are what the following layers see."""
    picked: dict = {}

    def choose(layer, row, q_row, k):
        T = row + 1
        if layer < observation_layers[0] or T <= budget:
            return range(T)
        if layer in observation_layers:
            group = q_row.shape[0] // k.shape[1]
            logits = torch.einsum("hd,khd->hk", q_row.float(), k.float().repeat_interleave(group, 1))
            score = torch.softmax(logits * q_row.shape[-1] ** -0.5, dim=-1).sum(0)  # [T]
            picked[row] = sorted(score[: T - 1].topk(budget - 1).indices.tolist()) + [T - 1]
            return range(T)
        return picked[row]
    return choose


# --- OmniKV ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,observation_layers,path", [("qwen3", (1, 3), "device"), ("qwen3", (2,), "device"),
                                                           ("qwen3", (1, 3), "host"), ("glm4_moe_lite", (1, 3), "device"),
                                                           ("qwen3_5", (1, 3), "device")])
def test_omnikv_selects_and_decodes_like_the_dense_reference(selection_dirs, arch, observation_layers, path):
    """``path``: pure-decode steps choose on the device (what a decode graph captures) or, forced, on the host."""
    model_dir = selection_dirs[arch]
    budget = 12
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=16,
              method="omnikv", method_config={"observation_layers": list(observation_layers), "token_budget": budget})
    method, device_steps = llm.engine.method, []
    assert method.config.observation_layers == observation_layers
    if path == "host":
        method._all_decode = lambda batch: False
    else:
        inner = method._choose_decode
        method._choose_decode = lambda *a: device_steps.append(1) or inner(*a)
    seen = capture_selections(llm)
    prompts = make_prompts(2)
    outs = llm.generate(prompts, GREEDY)
    check_against_reference(llm, outs, prompts, seen, lambda: omnikv_reference(observation_layers, budget))
    for (_, pos, layer), v in seen.items():
        if layer <= observation_layers[0] or layer in observation_layers:
            assert len(v) == pos + 1  # dense and observation layers read everything
        else:
            assert len(v) == min(budget, pos + 1)
    assert (len(device_steps) > 0) == (path == "device")
