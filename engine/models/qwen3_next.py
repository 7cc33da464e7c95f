"""Qwen3NextForCausalLM (Qwen3-Next): the hybrid decoder of ``engine.models.gated_deltanet`` (gated DeltaNet and
gated full-attention layers) with the sparse MoE block (softmax top-k experts plus a sigmoid-gated shared expert,
``engine.models.moe.SparseMoeBlock``) on the layers ``ModelConfig.is_moe_layer`` picks, a SwiGLU MLP elsewhere.

The DeltaNet's projections load from the key-head-grouped ``in_proj_qkvz`` / ``in_proj_ba``; expert weights from
per-expert keys or the fused transformers-5 ones. Read from transformers' ``modeling_qwen3_next.py``.
"""

from torch import nn

from engine.model_config import ModelConfig
from engine.models.gated_deltanet import GROUPED_LAYOUT, HybridForCausalLM
from engine.models.moe import PerExpertCheckpointNames, SparseMoeBlock


class Qwen3NextForCausalLM(PerExpertCheckpointNames, HybridForCausalLM):
    checkpoint_layout = GROUPED_LAYOUT

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SparseMoeBlock(config)
        return super().make_mlp(config, layer_idx)
