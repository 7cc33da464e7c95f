"""Qwen3MoeForCausalLM: the decoder with a sparse MoE block on the layers ModelConfig.is_moe_layer picks.

Expert weights load from per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj.weight`` or from the
fused transformers-5 keys ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I].
"""

import re
from typing import Any

from torch import nn

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.moe import SparseMoeBlock

_PER_EXPERT_KEY = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_GATE_UP_HALF = {"gate_proj": 0, "up_proj": 1}


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return SparseMoeBlock(config)
        return super().make_mlp(config, layer_idx)

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        match = _PER_EXPERT_KEY.match(name)
        if match is None:
            return super().checkpoint_target(name)
        expert, proj = int(match["expert"]), match["proj"]
        if proj == "down_proj":
            return f"{match['experts']}.down_proj", expert
        return f"{match['experts']}.gate_up_proj", (expert, _GATE_UP_HALF[proj])

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        experts, _, stacked = param_name.rpartition(".")
        if experts.endswith(".experts") and shard_id is not None:
            if stacked == "down_proj":
                return f"{experts}.{shard_id}.down_proj.weight"
            expert, half = shard_id
            return f"{experts}.{expert}.{('gate_proj', 'up_proj')[half]}.weight"
        return super().checkpoint_name(param_name, shard_id)
