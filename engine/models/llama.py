"""LlamaForCausalLM: the plain decoder (optional attention/MLP bias, llama3/linear/yarn RoPE scaling)."""

from engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
