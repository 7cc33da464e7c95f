"""The trained model's architecture and tokenizer: a small Qwen3 built from transformers' config class.

The tokenizer is the project's locally trained byte-level BPE with the ChatML tool-calling template
(`engine.tiny_checkpoint.train_tokenizer`), so the trained checkpoint renders chats exactly as the
random tiny checkpoints do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from engine.tiny_checkpoint import ENDOFTEXT, IM_END, train_tokenizer


@dataclass(slots=True)
class ModelShape:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    max_position_embeddings: int = 4096
    rope_theta: float = 100000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


def build_tokenizer(shape: ModelShape, max_length: int):
    tokenizer = train_tokenizer(shape.vocab_size)
    tokenizer.model_max_length = max_length
    return tokenizer


def build_model(shape: ModelShape, tokenizer):
    """A freshly initialised Qwen3ForCausalLM (fp32) of ``shape``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if len(tokenizer) > shape.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than vocab_size {shape.vocab_size}")
    end, eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT), tokenizer.convert_tokens_to_ids(IM_END)
    config = Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta}, tie_word_embeddings=False,
        bos_token_id=end, eos_token_id=eos, pad_token_id=end, architectures=["Qwen3ForCausalLM"],
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def save_checkpoint(model, tokenizer, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """config + safetensors (in ``dtype``) + tokenizer with chat template + generation config."""
    import torch
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    end, eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT), tokenizer.convert_tokens_to_ids(IM_END)
    GenerationConfig(bos_token_id=end, eos_token_id=[eos, end], pad_token_id=end).save_pretrained(out_dir)
    return out_dir
