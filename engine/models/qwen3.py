"""Qwen3ForCausalLM: the Llama decoder with per-head q/k RMSNorm before RoPE (ModelConfig.qk_norm)."""

from engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass
