"""Qwen3MoeForCausalLM: the decoder with a sparse MoE block on the layers ModelConfig.is_moe_layer picks.

Expert weights load from per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj.weight`` or from the
fused transformers-5 keys ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I].
"""

from torch import nn

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.moe import PerExpertCheckpointNames, SparseMoeBlock


class Qwen3MoeForCausalLM(PerExpertCheckpointNames, DecoderForCausalLM):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SparseMoeBlock(config)
        return super().make_mlp(config, layer_idx)
