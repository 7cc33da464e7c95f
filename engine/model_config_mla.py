"""The multi-head latent attention (MLA) part of ``ModelConfig``: DeepSeek-V3 / GLM-4.7-Flash's latent sizes and
softmax scale, and the fields of their DeepSeek MoE block (dense first layers, grouped sigmoid routing, shared
experts), read and checked from config.json. ``engine.model_config`` combines them with the common fields."""

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError

# Multi-head latent attention (MLA) architectures and the dense MLP layers each puts first by default
MLA_FIRST_DENSE = {"DeepseekV3ForCausalLM": 3, "Glm4MoeLiteForCausalLM": 1}


@dataclass(slots=True, frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): per token one latent row of
    ``kv_lora_rank`` values (normed, no RoPE) and ``qk_rope_head_dim`` shared rotary key values; per head a query
    of ``qk_nope_head_dim + qk_rope_head_dim``, keys and values expanded from the latent by ``kv_b_proj``."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float  # (nope + rope) ** -0.5, times YaRN's mscale squared where the config sets mscale_all_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def latent_attention(
    architecture: str, d: dict[str, Any], rope_scaling: dict[str, Any] | None
) -> LatentAttentionConfig | None:
    if architecture not in MLA_FIRST_DENSE:
        return None
    sizes = {k: int(d[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for name, size in sizes.items():
        if size <= 0:
            raise CheckpointError(f"config.json: {name} must be positive, got {size}")
    if sizes["qk_rope_head_dim"] % 2:
        raise CheckpointError(f"config.json: qk_rope_head_dim must be even, got {sizes['qk_rope_head_dim']}")
    q_lora_rank = d.get("q_lora_rank")
    if q_lora_rank is not None and int(q_lora_rank) <= 0:
        raise CheckpointError(f"config.json: q_lora_rank must be positive or null, got {q_lora_rank}")
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    if rope_scaling is not None and mscale_all_dim:
        factor = float(rope_scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return LatentAttentionConfig(q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                                 rope_interleave=bool(d.get("rope_interleave", True)), softmax_scale=scale, **sizes)


def deepseek_moe_fields(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """The DeepSeek MoE block's fields: which layers are dense, the grouped sigmoid routing, shared experts."""
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"config.json: scoring_func {d['scoring_func']!r} is not supported (only 'sigmoid')")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise CheckpointError(f"config.json: topk_method {d['topk_method']!r} is not supported (only 'noaux_tc')")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise CheckpointError(f"config.json: moe_layer_freq {d['moe_layer_freq']} is not supported (only 1)")
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("mlp_layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers or set(layer_types) - {"dense", "sparse"}:
            raise CheckpointError("config.json: mlp_layer_types must name 'dense' or 'sparse' for every layer")
        dense = tuple(i for i, kind in enumerate(layer_types) if kind == "dense")
    else:
        first_dense = d.get("first_k_dense_replace")
        dense = tuple(range(int(MLA_FIRST_DENSE[architecture] if first_dense is None else first_dense)))
    experts, groups = int(d.get("n_routed_experts") or 0), int(d.get("n_group") or 1)
    topk_groups = int(d.get("topk_group") or 1)
    if experts and (experts % groups or not 0 < topk_groups <= groups):
        raise CheckpointError(f"config.json: n_group {groups} must divide n_routed_experts {experts} and topk_group "
                              f"{topk_groups} lie in [1, n_group]")
    return dict(mlp_only_layers=dense, norm_topk_prob=bool(d.get("norm_topk_prob", True)), expert_scoring="sigmoid",
                expert_groups=groups, topk_groups=topk_groups,
                routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                shared_expert_intermediate_size=int(d.get("moe_intermediate_size") or 0)
                * int(d.get("n_shared_experts") or 0))
