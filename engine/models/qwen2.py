"""Qwen2ForCausalLM: the Llama decoder with q/k/v bias (ModelConfig sets attention_bias for it)."""

from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass
