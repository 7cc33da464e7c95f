"""The per-architecture part of the tiny checkpoints (``engine.tiny_checkpoint``): which architectures and dtypes
they come in, the checks on their shape, the transformers config each architecture's arguments build, and the
seeded random model instantiated from it (with the buffers and norms a fresh transformers model leaves at
constants perturbed, so the checkpoint exercises them as a trained one does).
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_5", "qwen3_5_moe",
                   "qwen3_next")
MLA_ARCHS = ("deepseek_v3", "glm4_moe_lite")  # latent attention with the DeepSeek MoE block
# gated DeltaNet (linear attention) layers with gated full-attention ones every ``full_attention_interval`` layers
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
HYBRID_NUM_LAYERS = 4  # default depth of a hybrid checkpoint: linear and full-attention layers both repeat
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def rope_parameters(rope_theta: float, rope_scaling: dict | None) -> dict:
    scaling = dict(rope_scaling or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    return {"rope_theta": float(rope_theta), **scaling}


def validate_shape(arch: str, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None,
                   dtype: str) -> int:
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    resolved_head_dim = head_dim if head_dim is not None else hidden_size // num_heads
    if resolved_head_dim <= 0 or resolved_head_dim % 2:
        raise ConfigError(f"head_dim must be a positive even number, got {resolved_head_dim}")
    if arch == "qwen2" and resolved_head_dim * num_heads != hidden_size:
        raise ConfigError("qwen2 requires head_dim == hidden_size // num_heads")
    return resolved_head_dim


def _hybrid_config(arch: str, common: dict[str, Any], moe: dict[str, Any], head_dim: int, hybrid: dict[str, Any]):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    hybrid = dict(hybrid)
    if hybrid.get("layer_types") is None:
        hybrid.pop("layer_types", None)
    else:
        hybrid.pop("full_attention_interval")
    factor = hybrid.pop("partial_rotary_factor")
    shared = hybrid.pop("shared_expert_intermediate_size")
    common = {**common, "rope_parameters": {**common["rope_parameters"], "partial_rotary_factor": factor}}
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, **hybrid, head_dim=head_dim, architectures=["Qwen3_5ForCausalLM"])
    moe = {k: v for k, v in moe.items() if arch == "qwen3_next" or k != "norm_topk_prob"}  # 3.5: always renormalized
    if arch == "qwen3_5_moe":
        common = {k: v for k, v in common.items() if k != "intermediate_size"}
        return Qwen3_5MoeTextConfig(**common, **moe, **hybrid, head_dim=head_dim,
                                    shared_expert_intermediate_size=shared, architectures=["Qwen3_5MoeForCausalLM"])
    return Qwen3NextConfig(**common, **moe, **hybrid, head_dim=head_dim, shared_expert_intermediate_size=shared,
                           architectures=["Qwen3NextForCausalLM"])


def _perturb_hybrid(model) -> None:
    """transformers starts the zero-centred norms at 0 (a scale of 1), the DeltaNet's gated norm at 1 and dt_bias at
    1: random values around those make the checkpoint exercise every scale, as a trained one does."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                param.normal_(1.0, 0.2)
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)


def build_config(arch: str, common: dict[str, Any], moe: dict[str, Any], head_dim: int,
                  mla: dict[str, Any] | None = None, hybrid: dict[str, Any] | None = None):
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch in HYBRID_ARCHS:
        assert hybrid is not None
        return _hybrid_config(arch, common, moe, head_dim, hybrid)
    if arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=head_dim, architectures=["Qwen3MoeForCausalLM"])
    assert mla is not None
    deepseek_moe = dict(n_routed_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                        moe_intermediate_size=moe["moe_intermediate_size"], norm_topk_prob=moe["norm_topk_prob"])
    common = {k: v for k, v in common.items() if k != "num_key_value_heads"}  # one latent row, not KV heads
    if arch == "deepseek_v3":
        return DeepseekV3Config(**common, **deepseek_moe, **mla, architectures=["DeepseekV3ForCausalLM"])
    mla = {k: v for k, v in mla.items() if k != "first_k_dense_replace"}
    return Glm4MoeLiteConfig(**common, **deepseek_moe, **mla, architectures=["Glm4MoeLiteForCausalLM"])


def instantiate_seeded(config, seed: int, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # HF starts DeepSeek routers' correction bias at zero; random values make it choose experts, as trained
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
        if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
            _perturb_hybrid(model)
    return model.to(getattr(torch, dtype)).eval()
