"""Glm4MoeLiteForCausalLM (GLM-4.7-Flash): the DeepSeek-V3 architecture (latent attention, grouped sigmoid
MoE with shared experts); its dense layers come from ``mlp_layer_types`` (else the first one, or
``first_k_dense_replace``), read by ModelConfig. Read from transformers' ``modeling_glm4_moe_lite.py``."""

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    pass
