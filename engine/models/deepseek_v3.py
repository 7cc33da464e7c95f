"""DeepseekV3ForCausalLM (DeepSeek-V3 / V3.1 and twins such as Kimi K2): multi-head latent attention
(``engine.models.mla``) and the DeepSeek MoE block.

The MoE block routes by sigmoid scores: a per-expert correction bias picks the experts (first the
``topk_group`` best of ``n_group`` expert groups, each group scored by its two best experts, then the top-k
experts inside them), while the weights are the uncorrected scores of the chosen experts, renormalized when
``norm_topk_prob`` and times ``routed_scaling_factor`` (``ops.route_grouped_sigmoid_from_hidden``: on a GPU one
kernel, with the fp32 gate product at decode sizes); shared experts (one SwiGLU MLP of
``n_shared_experts * moe_intermediate_size``) add to every token: stacked after the routed experts and run by
the same grouped kernel where that is one expert's size (``shares_expert_slot``). The first
``first_k_dense_replace`` layers have a dense MLP. A multi-token-prediction layer in the checkpoint
(``model.layers.{num_hidden_layers}...``) is skipped with a log line. Read from transformers'
``modeling_deepseek_v3.py``.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from agentrt_kernels import ops
from engine.errors import ConfigError
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM, DenseMLP
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.mla import LatentAttention
from engine.models.moe import PerExpertCheckpointNames, StackedExperts
from engine.parallel.state import current_group

log = logging.getLogger(__name__)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_SHARED_KEY = re.compile(r"^(?P<mlp>.+\.mlp)\.shared_experts\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_HALF = {"gate_proj": 0, "up_proj": 1}


class GroupedSigmoidRouter(nn.Module):
    """The router's weight and correction bias stay fp32 whatever the model dtype, as HF keeps them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts = config.num_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32), requires_grad=False)
        self.top_k, self.groups, self.topk_groups = config.num_experts_per_tok, config.expert_groups, config.topk_groups
        self.renormalize, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.shared_expert: int | None = None  # an expert every token takes with weight 1 (DeepseekMoE)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K] in x.dtype); K + 1 columns with a shared
        expert."""
        return ops.route_grouped_sigmoid_from_hidden(x, self.weight, self.e_score_correction_bias, self.top_k,
                                                     self.groups, self.topk_groups, self.renormalize, self.scaling,
                                                     self.shared_expert)

    def route_normed(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward(norm(x, residual))`` with the norm in the routing's launch where it takes one: (topk_ids,
        topk_weights, the normed rows, x + residual)."""
        if norm.zero_centered:  # a form the routing's launch does not compute
            normed, residual = norm(x, residual)
            return (*self(normed), normed, residual)
        return ops.route_grouped_sigmoid_from_hidden(x, self.weight, self.e_score_correction_bias, self.top_k,
                                                     self.groups, self.topk_groups, self.renormalize, self.scaling,
                                                     self.shared_expert, norm=(norm.weight, norm.eps),
                                                     residual=residual)


def shares_expert_slot(config: ModelConfig) -> bool:
    """Whether the shared experts are one expert of the routed experts' size (GLM-4.7-Flash, DeepSeek-V3, Kimi
    K2: ``n_shared_experts`` 1): it is then stacked after the routed experts and the router appends it to every
    token's choice with weight 1, so one grouped kernel runs it with them (no launches of its own; the sum is
    the same: the routed outputs, then the shared one, added in the experts' order)."""
    return config.shared_expert_intermediate_size == config.moe_intermediate_size > 0


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = current_group()
        self.gate = GroupedSigmoidRouter(config)
        routed = config.num_experts
        self.shared_experts = None
        if shares_expert_slot(config):
            self.gate.shared_expert = routed
            self.experts = StackedExperts(routed + 1, config.hidden_size, config.moe_intermediate_size, routed)
        else:
            self.experts = StackedExperts(routed, config.hidden_size, config.moe_intermediate_size)
            if config.shared_expert_intermediate_size:
                self.shared_experts = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                               reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, *self.gate(x))

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor,
                           norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(``forward(norm(x, residual))``, x + residual): the norm runs inside the router's launch
        (``DecoderLayer.forward``)."""
        topk_ids, topk_weights, normed, residual = self.gate.route_normed(x, residual, norm)
        return self._experts(normed, topk_ids, topk_weights), residual

    def _experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)  # the ranks' partial sums over their expert slices: one reduction


class DeepseekV3ForCausalLM(PerExpertCheckpointNames, DecoderForCausalLM):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # DecoderLayer.forward_fused computes the input norm inside the merged q_a / kv_a projection: a low-rank
        # query has one (LatentAttention.input_proj)
        self.fused_decode_path = config.mla.q_lora_rank is not None
        if config.mla.q_lora_rank is not None:  # LatentAttention.qkv_a_proj
            self.packed_modules_mapping = {**self.packed_modules_mapping, "q_a_proj": ("qkv_a_proj", 0),
                                           "kv_a_proj_with_mqa": ("qkv_a_proj", 1)}

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LatentAttention(config, layer_idx)

    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling,
                               config.max_position_embeddings)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return DeepseekMoE(config)
        return DenseMLP(config.hidden_size, config.intermediate_size)

    def checkpoint_target(self, name: str):
        match = _SHARED_KEY.match(name)
        if match is None or not shares_expert_slot(self.config):
            return super().checkpoint_target(name)
        slot = self.config.num_experts  # stacked after the routed experts (shares_expert_slot)
        if match["proj"] == "down_proj":
            return f"{match['mlp']}.experts.down_proj", slot
        return f"{match['mlp']}.experts.gate_up_proj", (slot, _HALF[match["proj"]])

    def checkpoint_name(self, param_name: str, shard_id) -> str:
        slot = self.config.num_experts
        if param_name.endswith(".experts.down_proj") and shard_id == slot:
            return param_name.replace(".experts.down_proj", ".shared_experts.down_proj.weight")
        if param_name.endswith(".experts.gate_up_proj") and isinstance(shard_id, tuple) and shard_id[0] == slot:
            proj = ("gate_proj", "up_proj")[shard_id[1]]
            return param_name.replace(".experts.gate_up_proj", f".shared_experts.{proj}.weight")
        return super().checkpoint_name(param_name, shard_id)

    def kv_projections(self):
        raise ConfigError(f"{self.config.architecture} caches latent rows: no per-head key / value projections")

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        match = _LAYER_KEY.match(name)
        if match is not None and int(match[1]) >= self.config.num_layers:
            if not getattr(self, "_logged_mtp", False):
                log.info("skipping checkpoint layer %s and beyond (multi-token prediction, not run)", match[1])
                self._logged_mtp = True
            return True
        return super().is_ignored_checkpoint_tensor(name)
