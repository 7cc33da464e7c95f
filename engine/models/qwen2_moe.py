"""Qwen2MoeForCausalLM: the Qwen3-MoE block plus a sigmoid-gated shared expert, q/k/v bias, no q/k norm."""

from engine.models.qwen3_moe import Qwen3MoeForCausalLM


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    pass
