"""DeepSeek's shared expert stacked after the routed experts (engine.models.deepseek_v3.shares_expert_slot): the
router appends it to every token's choice with weight 1 and the grouped experts run it, which must give what the
separate shared MLP gave (bit for bit on the CPU), load from the checkpoint's own names, and stay out of the
roofline's routed-expert count and bytes."""

import random

import pytest
import torch

from engine import LLM
from engine.loader import load_model
from engine.models import deepseek_v3
from engine.models.deepseek_v3 import DeepseekMoE
from engine.models.moe import StackedExperts
from benchmarks.roofline import expert_weight_bytes, measure_routed_experts
from tests.engine.test_models_vs_hf import DenseCausalRunner


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_the_stacked_shared_expert_equals_the_separate_mlp_bit_for_bit(arch, mla_dirs, monkeypatch):
    ids = torch.randint(5, 500, (24,), generator=torch.Generator().manual_seed(1))
    stacked, _ = load_model(mla_dirs[arch], dtype=torch.float32)
    blocks = [m for m in stacked.modules() if isinstance(m, DeepseekMoE)]
    assert blocks and all(b.shared_experts is None and b.experts.num_experts == b.experts.num_routed + 1
                          for b in blocks)
    monkeypatch.setattr(deepseek_v3, "shares_expert_slot", lambda config: False)
    separate, _ = load_model(mla_dirs[arch], dtype=torch.float32)
    assert all(b.shared_experts is not None for b in separate.modules() if isinstance(b, DeepseekMoE))
    with torch.no_grad():
        got = stacked.compute_logits(stacked(ids, torch.arange(24), DenseCausalRunner()))
        want = separate.compute_logits(separate(ids, torch.arange(24), DenseCausalRunner()))
    assert torch.equal(got, want)
    block, mlp = blocks[0], [b for b in separate.modules() if isinstance(b, DeepseekMoE)][0].shared_experts
    slot, inter = block.experts.num_routed, block.experts.intermediate_size
    assert torch.equal(block.experts.gate_up_proj[slot], mlp.gate_up_proj.weight)  # loaded from shared_experts.*
    assert torch.equal(block.experts.down_proj[slot], mlp.down_proj.weight)
    assert block.experts.gate_up_proj.shape[1] == 2 * inter


def test_a_checkpoint_without_the_shared_expert_is_refused_naming_it(mla_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = mla_dirs["glm4_moe_lite"]
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(f).items() if ".shared_experts.up_proj" not in k}
            save_file(tensors, dst / f.name)
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    with pytest.raises(Exception, match=r"shared_experts\.up_proj\.weight"):
        load_model(dst, dtype=torch.float32)


def test_the_roofline_counts_routed_experts_only(mla_dirs):
    llm = LLM(mla_dirs["glm4_moe_lite"], dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=256)
    engine = llm.engine
    experts = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
    routed = experts[0].num_routed
    per_expert = sum(p[0].numel() * p.element_size() for p in experts[0].parameters())
    assert expert_weight_bytes(engine.model) == per_expert * routed * len(experts)
    rng = random.Random(0)
    requests = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    distinct = []
    for block in [m for m in engine.model.modules() if isinstance(m, DeepseekMoE)]:
        for name in ("forward", "route_normed"):  # the router alone, or with the norm before it

            def recording(x, *args, route=getattr(block.gate, name)):
                out = route(x, *args)
                if x.shape[0] == len(requests):  # the last column: the shared expert
                    distinct.append(len(set(out[0][:, :-1].flatten().tolist())))
                return out

            setattr(block.gate, name, recording)
    got = measure_routed_experts(engine, requests, steps=3)
    assert distinct and abs(got - sum(distinct) / len(distinct)) < 1e-9
    assert got <= routed
