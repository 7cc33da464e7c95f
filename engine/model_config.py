"""ModelConfig: the engine's normalized view of a Hugging Face ``config.json``.

Accepts both the pre-5 transformers layout (``rope_theta``/``rope_scaling``, ``num_experts``) and the
transformers-5 layout (``rope_parameters``, ``num_local_experts``, ``dtype``). The latent-attention (MLA) and
hybrid linear-attention sub-configs are read by ``engine.model_config_mla`` and ``engine.model_config_linear``;
their names are importable from here too.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import CheckpointError, EngineError
from engine.model_config_linear import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LinearAttentionConfig,
    hybrid_fields,
    text_config,
)
from engine.model_config_mla import LatentAttentionConfig, deepseek_moe_fields, latent_attention
from engine.models.registry import check_supported

# the sub-configs and layer kinds are imported from here by the models, tests and tools
__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "LatentAttentionConfig", "LinearAttentionConfig", "ModelConfig"]

_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # DeepSeek routing: sigmoid scores plus a correction bias choose ``topk_groups`` of ``expert_groups`` groups,
    # then the top-k experts inside them; the weights (renormalized per ``norm_topk_prob``) times the factor
    expert_scoring: str = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # MLA: ``num_kv_heads`` is 1 and ``head_dim`` the latent row (``mla.cache_dim``) that attention reads
    mla: LatentAttentionConfig | None = None
    # hybrid linear-attention models: the layer kinds and the gated DeltaNet's sizes (None: every layer attends)
    linear: LinearAttentionConfig | None = None
    # the leading fraction of each head's channels that RoPE rotates (Qwen3-Next / Qwen3.5: 0.25)
    partial_rotary_factor: float = 1.0
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise CheckpointError("rope_scaling must name its rope_type")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise CheckpointError(
                    f"config.json: num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise CheckpointError("config.json: moe_intermediate_size and decoder_sparse_step must be positive")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        rows = 1 if self.mla is not None else 2  # MLA's values are a slice of its one latent row
        return rows * self.kv_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention layers of a hybrid model, else every layer."""
        if self.linear is None:
            return self.num_layers
        return sum(1 for t in self.linear.layer_types if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> int:
        """Linear-attention (gated DeltaNet) layers: a recurrent state per request each, no KV cache."""
        return 0 if self.linear is None else self.num_layers - self.kv_layers

    @property
    def rotary_dim(self) -> int:
        """The leading channels of a head that RoPE rotates (``head_dim`` unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def value_dim(self) -> int:
        """The width attention returns per head: the latent rank under MLA, else ``head_dim``."""
        return self.head_dim if self.mla is None else self.mla.kv_lora_rank

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        try:
            return _parse(cls, d, generation_config or {})
        except EngineError:
            raise
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required key {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a malformed value: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise CheckpointError(f"model directory {model_dir} does not exist")
        config = _read_json(model_dir / "config.json", required=True)
        generation_config = _read_json(model_dir / "generation_config.json", required=False)
        return cls.from_hf_dict(config, generation_config)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _parse(cls: type[ModelConfig], d: dict[str, Any], generation_config: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(d)
    check_supported(architecture)
    d = text_config(architecture, d)
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        raise CheckpointError(f"quantization_config ({method}) is not supported: load a bf16 / fp16 / fp32 checkpoint")
    num_heads = int(d["num_attention_heads"])
    hidden_size = int(d["hidden_size"])
    rope_theta, rope_scaling = _rope(d)
    attention_bias, o_proj_bias, qk_norm = _attention_flags(architecture, d)
    bos_token_id = d.get("bos_token_id", generation_config.get("bos_token_id"))
    mla = latent_attention(architecture, d, rope_scaling)
    moe_layout = deepseek_moe_fields(architecture, d) if mla is not None else {}
    moe_layout |= hybrid_fields(architecture, d, rope_scaling)
    fields = dict(
        architecture=architecture,
        model_type=str(d.get("model_type", "")),
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(d.get("intermediate_size") or 0),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=1 if mla else int(d.get("num_key_value_heads") or num_heads),
        head_dim=mla.cache_dim if mla else int(d.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        qk_norm=qk_norm,
        mlp_bias=bool(d.get("mlp_bias", False)),
        num_experts=int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
        mla=mla,
        torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch."),
        eos_token_ids=_eos_token_ids(d, generation_config),
        bos_token_id=None if bos_token_id is None else int(bos_token_id),
    )
    return cls(**(fields | moe_layout))


def _architecture(d: dict[str, Any]) -> str:
    architectures = d.get("architectures")
    if architectures:
        return str(architectures[0])
    model_type = d.get("model_type")
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise CheckpointError(f"config.json names no architecture (model_type {model_type!r})")


def _attention_flags(architecture: str, d: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, per-head q/k RMSNorm) as each HF implementation builds them."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture == "Qwen2MoeForCausalLM":
        return bool(d.get("qkv_bias", True)), False, False
    bias = bool(d.get("attention_bias", False))
    return bias, bias, architecture.startswith("Qwen3")


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError("per-layer-type rope_parameters are not supported")
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    rope_theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or _DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    return rope_theta, {"rope_type": rope_type, **params}


def _eos_token_ids(d: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (d.get("eos_token_id"), generation_config.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)
