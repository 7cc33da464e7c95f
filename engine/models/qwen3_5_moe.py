"""Qwen3.5-MoE text models: the hybrid decoder of ``engine.models.gated_deltanet`` with the sparse MoE block on
every layer (softmax top-k experts, weights always renormalized, plus a sigmoid-gated shared expert:
``engine.models.moe.SparseMoeBlock``). Read from transformers' ``modeling_qwen3_5_moe.py``.

``Qwen3_5MoeForConditionalGeneration``: the text model of the vision-language checkpoint, as in
``engine.models.qwen3_5``. Expert weights load from per-expert keys or the fused transformers-5 ones.
"""

from torch import nn

from engine.model_config import ModelConfig
from engine.models.gated_deltanet import SPLIT_LAYOUT, HybridForCausalLM
from engine.models.moe import PerExpertCheckpointNames, SparseMoeBlock


class Qwen3_5MoeForCausalLM(PerExpertCheckpointNames, HybridForCausalLM):
    checkpoint_layout = SPLIT_LAYOUT

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    pass
