"""Sparse MoE block (Qwen2-MoE / Qwen3-MoE): fp32 softmax router, top-k, stacked SwiGLU experts.

Routing and experts run through ``agentrt_kernels.ops`` (``route_topk``, ``fused_moe``): Triton kernels on a GPU;
elsewhere the torch reference, where tokens are grouped by expert and each expert that got tokens runs once.
"""

import re
from typing import Any

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.decoder import DenseMLP
from engine.models.layers import Linear, copy_into, new_parameter
from engine.parallel.layers import check_divisible
from engine.parallel.state import current_group
from agentrt_kernels import ops


class StackedExperts(nn.Module):
    """gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], the transformers-5 layout.

    Shard ids: gate_up_proj takes (expert, 0 = gate | 1 = up), down_proj takes expert; None = all routed experts.
    Tensor parallel: every rank holds every expert, with a slice of each expert's intermediate dim (I / N
    gate rows, I / N up rows, I / N down columns), so ``forward`` returns this rank's partial sum.
    ``num_routed`` < ``num_experts``: the experts from ``num_routed`` on are shared experts a router appends to
    every token's choice (DeepSeek's, run by the same kernel as the routed ones); a stacked checkpoint tensor
    holds the routed experts only.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 num_routed: int | None = None) -> None:
        super().__init__()
        self.tp = current_group()
        check_divisible("the expert intermediate size", intermediate_size, self.tp.world_size)
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.num_routed = num_experts if num_routed is None else num_routed
        self.local_intermediate = intermediate_size // self.tp.world_size
        self.gate_up_proj = new_parameter(num_experts, 2 * self.local_intermediate, hidden_size)
        self.down_proj = new_parameter(num_experts, hidden_size, self.local_intermediate)
        self.gate_up_proj.weight_loader = self.load_gate_up
        self.gate_up_proj.shard_ids = tuple((e, half) for e in range(num_experts) for half in (0, 1))
        self.down_proj.weight_loader = self.load_down
        self.down_proj.shard_ids = tuple(range(num_experts))
        # When set (a 0-d float tensor on the weights' device), each forward adds the number of distinct
        # experts its tokens route to: benchmarks count the expert bytes a step really reads. No host sync.
        self.routed_counter: torch.Tensor | None = None

    def _check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"expert {expert} out of range [0, {self.num_experts})")

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        if loaded.dim() <= dim or loaded.shape[dim] != self.intermediate_size:
            raise CheckpointError(f"shape {tuple(loaded.shape)}: dim {dim} is not the expert intermediate "
                                  f"size {self.intermediate_size}")
        offset, length = self.tp.shard(self.intermediate_size)
        return loaded.narrow(dim, offset, length)

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        local = self.local_intermediate
        if shard_id is None:  # [E, 2I, H] (the routed experts): gate rows, then up rows
            if loaded.dim() != 3 or loaded.shape[1] != 2 * self.intermediate_size:
                raise CheckpointError(f"shape {tuple(loaded.shape)} does not match expected "
                                      f"{(self.num_routed, 2 * self.intermediate_size, param.shape[2])}")
            routed = param.data[: self.num_routed]
            for half, part in enumerate(loaded.split(self.intermediate_size, dim=1)):
                copy_into(routed.narrow(1, half * local, local), self._rank_slice(part, 1))
            return
        expert, half = shard_id
        self._check_expert(expert)
        copy_into(param.data[expert].narrow(0, half * local, local), self._rank_slice(loaded, 0))

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        if shard_id is not None:
            self._check_expert(shard_id)
        dst = param.data[: self.num_routed] if shard_id is None else param.data[shard_id]
        copy_into(dst, self._rank_slice(loaded, loaded.dim() - 1))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, K] int64; topk_weights [T, K] in x.dtype -> [T, H] (this rank's partial sum).

        On a GPU the fused Triton kernel runs (no host sync, CUDA-graph capturable); elsewhere a torch loop
        over the experts that received tokens.
        """
        if self.routed_counter is not None:  # routed experts only: shared ones are read every step
            hit = torch.zeros(self.num_experts, dtype=self.routed_counter.dtype, device=x.device)
            self.routed_counter += hit.index_fill_(0, topk_ids.flatten(), 1)[: self.num_routed].sum()
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = current_group()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = DenseMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          reduce_results=False)
            self.shared_expert_gate = Linear(config.hidden_size, 1)

    def route(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K] in x.dtype), as HF's TopKRouter
        (``router_logits``: ``gate(x)``, computed by the caller). On a GPU the softmax, top-k and
        renormalization are one Triton launch (exact ties go to the lower expert id)."""
        if router_logits is None:
            router_logits = self.gate(x)
        return ops.route_topk(router_logits, self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x, router_logits)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # the ranks' partial sums over their expert slices: one reduction


_PER_EXPERT_KEY = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_GATE_UP_HALF = {"gate_proj": 0, "up_proj": 1}


class PerExpertCheckpointNames:
    """Checkpoint names of a model with ``StackedExperts``: per-expert keys
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` load into the stacked parameters (the fused transformers-5 keys
    ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I] load as they are). A mixin
    before ``DecoderForCausalLM``."""

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
