"""Config dicts of real model shapes, for benchmarks with random weights.

Each dict is shaped like the config.json that transformers 5.17 writes (``rope_parameters`` holding
``rope_theta``, ``num_local_experts`` for MoE, ``dtype``), so it can be consumed like one.
"""

from __future__ import annotations

import copy
from typing import Any

from engine.errors import ConfigError

_QWEN_SPECIAL_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "dtype": "bfloat16",
}

QWEN3_4B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
    "tie_word_embeddings": True,
    **_QWEN_SPECIAL_IDS,
    "dtype": "bfloat16",
}

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    **_QWEN_SPECIAL_IDS,
    "dtype": "bfloat16",
}

QWEN2_5_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    **_QWEN_SPECIAL_IDS,
    "dtype": "bfloat16",
}

# GLM-4.7-Flash (zai-org/GLM-4.7-Flash): latent attention (512 + 64 cached per token and layer), 64 routed experts
# of which 4 a token plus one shared expert, one dense first layer; transformers' Glm4MoeLiteConfig defaults
GLM_4_7_FLASH: dict[str, Any] = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.8,
    "kv_lora_rank": 512,
    "q_lora_rank": 768,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "mlp_layer_types": ["dense"] + ["sparse"] * 46,
    "rope_interleave": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": [154820, 154827, 154829],
    "dtype": "bfloat16",
}

# A 16B-class DeepSeek-V2-Lite-like model under the DeepSeek-V3 architecture (sigmoid routing): full-rank
# queries, 64 routed experts of which 6 a token plus two shared, YaRN to 160K with mscale in the softmax scale
DEEPSEEK_V3_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "first_k_dense_replace": 1,
    "rope_interleave": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                        "original_max_position_embeddings": 4096},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "dtype": "bfloat16",
}

# Qwen3-Next-80B-A3B: 48 layers, 3 of 4 gated DeltaNet (16 key / 32 value heads of 128), every 4th gated full
# attention (16 query / 2 KV heads of 256, a quarter rotated); 512 experts of which 10 a token plus a shared
# expert; transformers' Qwen3NextConfig defaults
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "tie_word_embeddings": False,
    **_QWEN_SPECIAL_IDS,
    "dtype": "bfloat16",
}

# A Qwen3.6-27B-like dense hybrid: 64 layers, 3 of 4 gated DeltaNet (16 key / 48 value heads of 128), every 4th
# gated full attention (24 query / 4 KV heads of 256, a quarter rotated); the sizes as we read the published
# Qwen3.5 / 3.6 27B configs (a benchmark shape with random weights)
QWEN3_6_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 248044,
    "eos_token_id": 248046,
    "dtype": "bfloat16",
}

TINY: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "tie_word_embeddings": False,
    "bos_token_id": 507,
    "eos_token_id": 509,
    "dtype": "bfloat16",
}

# CPU smoke shapes of the latent-attention and hybrid families (benchmarks' code paths, not their figures)
TINY_MLA: dict[str, Any] = {
    **{k: v for k, v in GLM_4_7_FLASH.items() if k not in ("mlp_layer_types", "eos_token_id")},
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32, "v_head_dim": 32, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "max_position_embeddings": 4096, "bos_token_id": 507, "eos_token_id": 509,
}
TINY_HYBRID: dict[str, Any] = {
    **{k: v for k, v in QWEN3_6_27B.items() if k not in ("layer_types", "bos_token_id", "eos_token_id")},
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "layer_types": ["linear_attention", "full_attention"] * 2, "max_position_embeddings": 4096,
    "bos_token_id": 507, "eos_token_id": 509,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "qwen3-4b": QWEN3_4B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen2.5-7b": QWEN2_5_7B,
    "glm-4.7-flash": GLM_4_7_FLASH,
    "deepseek-v3-lite": DEEPSEEK_V3_LITE,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "qwen3.6-27b": QWEN3_6_27B,
    "tiny": TINY,
    "tiny-mla": TINY_MLA,
    "tiny-hybrid": TINY_HYBRID,
}


def get_shape(name: str) -> dict[str, Any]:
    """A fresh copy of the named config dict; raises ConfigError for an unknown name."""
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    return copy.deepcopy(SHAPES[name])
