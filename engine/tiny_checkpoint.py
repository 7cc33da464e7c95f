"""Tiny Hugging Face checkpoints: the embedded trained model, and seeded random ones for tests and examples.

``embedded_model_dir()`` is the default model of every command: a tiny Qwen3 trained on long-context
retrieval, shipped as package data (docs/quality.md). Random checkpoints are built locally: a byte-level BPE
tokenizer trained on an embedded corpus with a ChatML chat template with tool calling (``engine.tiny_tokenizer``),
and a model of one of the supported architectures whose weights depend only on the arguments
(``engine.tiny_configs``). This module writes them, caches the test checkpoint, and is the ``agentrt make-tiny``
command; the tokenizer's and the architectures' names are importable from here too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.cli_args import CommandLineParser, json_object, positive_int, usage_error
from engine.errors import ConfigError
from engine.tiny_configs import (
    HYBRID_ARCHS,
    HYBRID_MODEL_TYPES,
    HYBRID_NUM_LAYERS,
    MLA_ARCHS,
    SUPPORTED_ARCHS,
    SUPPORTED_DTYPES,
    build_config,
    instantiate_seeded,
    rope_parameters,
    validate_shape,
)
from engine.tiny_tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    EXTRA_ADDED_TOKENS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TRAINING_CORPUS,
    train_tokenizer,
)

# the tokenizer's and the architectures' names are imported from here by tests, tools and the trained model
__all__ = [
    "CHAT_TEMPLATE", "DEFAULT_MODEL_ARGS", "DEFAULT_MODEL_NAME", "EMBEDDED_MODEL_DIR", "ENDOFTEXT",
    "EXTRA_ADDED_TOKENS", "HYBRID_ARCHS", "HYBRID_MODEL_TYPES", "HYBRID_NUM_LAYERS", "IM_END", "IM_START", "MLA_ARCHS",
    "SPECIAL_TOKENS", "SUPPORTED_ARCHS", "SUPPORTED_DTYPES", "TOOL_CALL_END", "TOOL_CALL_START", "TRAINING_CORPUS",
    "cached_checkpoint_dir", "embedded_model_dir", "main", "make_tiny_checkpoint", "random_model_dir",
    "train_tokenizer",
]

VOCAB_PAD_MULTIPLE = 64
CHECKPOINT_FORMAT_VERSION = 1

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "data" / "qwen3-tiny-trained"

DEFAULT_MODEL_NAME = "qwen3-tiny"
DEFAULT_MODEL_ARGS: dict[str, Any] = {
    "arch": "qwen3",
    "seed": 0,
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "rope_theta": 1000000.0,
}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _model_vocab_size(requested: int, tokenizer_length: int) -> int:
    if tokenizer_length <= requested:
        return requested
    return _round_up(tokenizer_length, VOCAB_PAD_MULTIPLE)


def _special_token_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS + EXTRA_ADDED_TOKENS}


def _write_generation_config(out_dir: Path, ids: dict[str, int]) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    ).save_pretrained(out_dir)


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    initializer_range: float = 0.02,
    dtype: str = "float32",
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    kv_lora_rank: int = 32,
    q_lora_rank: int | None = 48,
    qk_rope_head_dim: int = 8,
    n_group: int = 1,
    topk_group: int = 1,
    first_k_dense_replace: int = 1,
    rope_interleave: bool = True,
    full_attention_interval: int = 2,
    layer_types: list[str] | None = None,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    linear_conv_kernel_dim: int = 4,
    partial_rotary_factor: float = 0.25,
    shared_expert_intermediate_size: int = 32,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random-initialised HF checkpoint (config, safetensors, tokenizer, generation config) to out_dir.

    MLA architectures (``MLA_ARCHS``) take ``num_heads``, ``head_dim`` as the no-RoPE query / key and the value
    head size, ``kv_lora_rank``, ``q_lora_rank`` (None: a full query projection), ``qk_rope_head_dim``, the
    expert groups and the dense first layers; ``num_kv_heads`` does not apply.

    Hybrid architectures (``HYBRID_ARCHS``, ``HYBRID_NUM_LAYERS`` layers unless ``num_layers`` says) take the gated
    DeltaNet's sizes (``linear_*``), ``layer_types`` or else ``full_attention_interval``, ``partial_rotary_factor``
    and (MoE ones) ``shared_expert_intermediate_size``; other architectures default to 2 layers."""
    if num_layers is None:
        num_layers = HYBRID_NUM_LAYERS if arch in HYBRID_ARCHS else 2
    if arch in MLA_ARCHS:
        num_kv_heads = num_heads
    resolved_head_dim = validate_shape(arch, hidden_size, num_heads, num_kv_heads, head_dim, dtype)
    if arch in HYBRID_ARCHS and (linear_num_value_heads % linear_num_key_heads or full_attention_interval <= 0):
        raise ConfigError(f"linear_num_value_heads ({linear_num_value_heads}) must be a multiple of "
                          f"linear_num_key_heads ({linear_num_key_heads}) and full_attention_interval positive")
    if arch in ("qwen3_moe", "qwen3_5_moe", "qwen3_next", *MLA_ARCHS) and not 0 < num_experts_per_tok <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({num_experts_per_tok}) must be in 1..num_experts ({num_experts})")
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.model_max_length = max_position_embeddings
    ids = _special_token_ids(tokenizer)
    common = {
        "vocab_size": _model_vocab_size(vocab_size, len(tokenizer)),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": rope_parameters(rope_theta, rope_scaling),
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "dtype": dtype,
    }
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
    }
    mla = dict(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
               qk_nope_head_dim=resolved_head_dim, v_head_dim=resolved_head_dim, n_group=n_group,
               topk_group=topk_group, first_k_dense_replace=first_k_dense_replace, rope_interleave=rope_interleave)
    hybrid = dict(full_attention_interval=full_attention_interval, layer_types=layer_types,
                  linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
                  linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
                  linear_conv_kernel_dim=linear_conv_kernel_dim, partial_rotary_factor=partial_rotary_factor,
                  shared_expert_intermediate_size=shared_expert_intermediate_size)
    config = build_config(arch, common, moe, resolved_head_dim, mla, hybrid)
    model = instantiate_seeded(config, seed, dtype)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_path, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(out_path)
    _write_generation_config(out_path, ids)
    return out_path


def _cache_root() -> Path:
    configured = os.environ.get("AGENTRT_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "agentrt"
    return base / "models"


def _args_digest(args: dict[str, Any]) -> str:
    import tokenizers
    import torch
    import transformers

    payload = {
        "args": args,
        "format": CHECKPOINT_FORMAT_VERSION,
        "template": CHAT_TEMPLATE,
        "corpus": TRAINING_CORPUS,
        "versions": [transformers.__version__, tokenizers.__version__, torch.__version__.split("+")[0]],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_checkpoint_dir(name: str, **kwargs: Any) -> Path:
    """Build make_tiny_checkpoint(**kwargs) once into the cache (atomically) and return its directory."""
    final_dir = _cache_root() / f"{name}-{_args_digest(kwargs)}"
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        make_tiny_checkpoint(staging_dir, **kwargs)
        os.rename(staging_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir


def embedded_model_dir() -> Path:
    """The embedded default model: a tiny Qwen3 trained on long-context retrieval (package data; docs/quality.md)."""
    return EMBEDDED_MODEL_DIR


def random_model_dir() -> Path:
    """A small random qwen3 for tests, built on first use into the cache and reused afterwards."""
    return cached_checkpoint_dir(DEFAULT_MODEL_NAME, **DEFAULT_MODEL_ARGS)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = CommandLineParser(prog="agentrt make-tiny", description=(
        "Write a seeded random Hugging Face checkpoint of a supported architecture: config.json,\n"
        "safetensors, a locally trained tokenizer and a ChatML chat template with tool calls."))
    parser.add_argument("--arch", default="llama", choices=SUPPORTED_ARCHS, help="the architecture")
    parser.add_argument("--out", required=True, type=Path, help="the directory to write (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--vocab-size", type=positive_int, default=512,
                        help="tokenizer vocabulary (the model's is padded to a multiple of 64)")
    parser.add_argument("--hidden-size", type=positive_int, default=64, help="model width")
    parser.add_argument("--num-layers", type=positive_int, default=None,
                        help=f"decoder layers (default: {HYBRID_NUM_LAYERS} for {', '.join(HYBRID_ARCHS)}, else 2)")
    parser.add_argument("--num-heads", type=positive_int, default=4, help="query heads")
    parser.add_argument("--num-kv-heads", type=positive_int, default=2, help="key/value heads (divides --num-heads)")
    parser.add_argument("--head-dim", type=positive_int, default=None,
                        help="size of one head (default: hidden size / heads)")
    parser.add_argument("--intermediate-size", type=positive_int, default=128, help="MLP width (dense architectures)")
    parser.add_argument("--max-position-embeddings", type=positive_int, default=2048, help="the longest context")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="share the embedding and output matrices")
    parser.add_argument("--rope-scaling", type=json_object, default=None,
                        help="JSON object, e.g. '{\"rope_type\": \"linear\", \"factor\": 2.0}' (default: none)")
    parser.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base")
    parser.add_argument("--initializer-range", type=float, default=0.02, help="std of the random weights")
    parser.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES, help="dtype of the weights")
    parser.add_argument("--num-experts", type=positive_int, default=4, help="experts per MoE layer (qwen3_moe)")
    parser.add_argument("--num-experts-per-tok", type=positive_int, default=2, help="experts routed per token (qwen3_moe)")
    parser.add_argument("--moe-intermediate-size", type=positive_int, default=32, help="expert MLP width (qwen3_moe)")
    parser.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false",
                        help="do not renormalise the routed experts' weights (qwen3_moe)")
    parser.add_argument("--kv-lora-rank", type=positive_int, default=32, help="latent rank (deepseek_v3, glm4_moe_lite)")
    parser.add_argument("--q-lora-rank", type=positive_int, default=48,
                        help="query low rank (deepseek_v3, glm4_moe_lite)")
    parser.add_argument("--qk-rope-head-dim", type=positive_int, default=8,
                        help="shared rotary key width (deepseek_v3, glm4_moe_lite; --head-dim is the rest of a head)")
    parser.add_argument("--full-attention-interval", type=positive_int, default=2,
                        help="every n-th layer is full attention, the others linear (qwen3_5, qwen3_5_moe, qwen3_next)")
    parser.add_argument("--linear-num-key-heads", type=positive_int, default=2,
                        help="gated DeltaNet query/key heads (hybrid archs)")
    parser.add_argument("--linear-num-value-heads", type=positive_int, default=4,
                        help="gated DeltaNet value heads, a multiple of the key heads (hybrid archs)")
    parser.add_argument("--shared-expert-intermediate-size", type=positive_int, default=32,
                        help="shared expert MLP width (qwen3_5_moe, qwen3_next)")
    parser.add_argument("--max-shard-size", default=None,
                        help="split the safetensors into shards of at most this size, e.g. 1MB (default: one file)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = vars(_parse_args(argv))
    out_dir = args.pop("out")
    try:
        print(make_tiny_checkpoint(out_dir, **args))
    except ConfigError as exc:
        return usage_error("agentrt make-tiny", exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
