"""ModelConfig: the engine's normalized view of a Hugging Face ``config.json``.

Accepts both the pre-5 transformers layout (``rope_theta``/``rope_scaling``, ``num_experts``) and the
transformers-5 layout (``rope_parameters``, ``num_local_experts``, ``dtype``).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import CheckpointError, EngineError
from engine.models.registry import check_supported

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
# Multi-head latent attention (MLA) architectures and the dense MLP layers each puts first by default
_MLA_FIRST_DENSE = {"DeepseekV3ForCausalLM": 3, "Glm4MoeLiteForCausalLM": 1}
_DEFAULT_ROPE_THETA = 10000.0
# Hybrid linear-attention architectures (gated DeltaNet + gated full attention), with their MoE layout: "dense" (every
# layer a SwiGLU MLP), "sparse" (every layer the softmax top-k MoE with a sigmoid-gated shared expert, top-k weights
# always renormalized), "config" (Qwen3-Next: the MoE block where num_experts / decoder_sparse_step / mlp_only_layers
# put it, norm_topk_prob defaulting to true). The ConditionalGeneration ones are the text model of a vision-language
# checkpoint: config.json nests it under ``text_config``.
_HYBRID_MOE_LAYOUT = {
    "Qwen3NextForCausalLM": "config",
    "Qwen3_5ForCausalLM": "dense",
    "Qwen3_5ForConditionalGeneration": "dense",
    "Qwen3_5MoeForCausalLM": "sparse",
    "Qwen3_5MoeForConditionalGeneration": "sparse",
}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# Keys of a nested config.json read from the top level rather than ``text_config`` (transformers ties the output
# embedding by the top-level config's ``tie_word_embeddings``)
_TOP_LEVEL_KEYS = ("architectures", "tie_word_embeddings", "quantization_config")


@dataclass(slots=True, frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): per token one latent row of
    ``kv_lora_rank`` values (normed, no RoPE) and ``qk_rope_head_dim`` shared rotary key values; per head a query
    of ``qk_nope_head_dim + qk_rope_head_dim``, keys and values expanded from the latent by ``kv_b_proj``."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float  # (nope + rope) ** -0.5, times YaRN's mscale squared where the config sets mscale_all_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(slots=True, frozen=True)
class LinearAttentionConfig:
    """Hybrid models (Qwen3-Next, Qwen3.5): ``layer_types[i]`` is ``"linear_attention"`` (a gated DeltaNet: no KV
    cache, a fixed-size state per request) or ``"full_attention"`` (gated attention over the KV cache). A linear
    layer projects ``linear_num_key_heads`` query/key heads of ``linear_key_head_dim`` and ``linear_num_value_heads``
    value heads of ``linear_value_head_dim``; q, k and v pass a causal depthwise conv of ``linear_conv_kernel_dim``
    taps. Per request and linear layer it keeps a conv state ``conv_state_shape`` (model dtype) and a recurrent
    state ``recurrent_state_shape`` (``recurrent_dtype``)."""

    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    recurrent_dtype: str = "float32"  # config.json's ``mamba_ssm_dtype`` where it names one (transformers: fp32)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k, then v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One request's conv state: the last ``kernel - 1`` inputs of every channel (whole model, one rank)."""
        return self.rank_conv_state_shape(1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One request's recurrent state: a ``[key_head_dim, value_head_dim]`` matrix per value head."""
        return self.rank_recurrent_state_shape(1)

    def rank_conv_state_shape(self, world_size: int) -> tuple[int, int]:
        """The conv state one of ``world_size`` tensor-parallel ranks holds: its key heads' q and k channels and
        its value heads' v channels (each rank a key head's slice with its value heads)."""
        return (self.conv_dim // world_size, self.linear_conv_kernel_dim - 1)

    def rank_recurrent_state_shape(self, world_size: int) -> tuple[int, int, int]:
        return (self.linear_num_value_heads // world_size, self.linear_key_head_dim, self.linear_value_head_dim)

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == LINEAR_ATTENTION

    def kind_index(self, layer_idx: int) -> int:
        """The layer's ordinal among the layers of its kind: its KV-cache layer for a full-attention layer, its
        state index (``LayerRunner.linear_state``) for a linear one."""
        kind = self.layer_types[layer_idx]
        return sum(1 for t in self.layer_types[:layer_idx] if t == kind)


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
    d = _text_config(architecture, d)
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
    mla = _latent_attention(architecture, d, rope_scaling)
    moe_layout = _deepseek_moe(architecture, d) if mla is not None else {}
    moe_layout |= _hybrid(architecture, d, rope_scaling)
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


def _latent_attention(
    architecture: str, d: dict[str, Any], rope_scaling: dict[str, Any] | None
) -> LatentAttentionConfig | None:
    if architecture not in _MLA_FIRST_DENSE:
        return None
    sizes = {k: int(d[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for name, size in sizes.items():
        if size <= 0:
            raise CheckpointError(f"config.json: {name} must be positive, got {size}")
    if sizes["qk_rope_head_dim"] % 2:
        raise CheckpointError(f"config.json: qk_rope_head_dim must be even, got {sizes['qk_rope_head_dim']}")
    q_lora_rank = d.get("q_lora_rank")
    if q_lora_rank is not None and int(q_lora_rank) <= 0:
        raise CheckpointError(f"config.json: q_lora_rank must be positive or null, got {q_lora_rank}")
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    if rope_scaling is not None and mscale_all_dim:
        factor = float(rope_scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return LatentAttentionConfig(q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                                 rope_interleave=bool(d.get("rope_interleave", True)), softmax_scale=scale, **sizes)


def _deepseek_moe(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """The DeepSeek MoE block's fields: which layers are dense, the grouped sigmoid routing, shared experts."""
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"config.json: scoring_func {d['scoring_func']!r} is not supported (only 'sigmoid')")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise CheckpointError(f"config.json: topk_method {d['topk_method']!r} is not supported (only 'noaux_tc')")
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise CheckpointError(f"config.json: moe_layer_freq {d['moe_layer_freq']} is not supported (only 1)")
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("mlp_layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers or set(layer_types) - {"dense", "sparse"}:
            raise CheckpointError("config.json: mlp_layer_types must name 'dense' or 'sparse' for every layer")
        dense = tuple(i for i, kind in enumerate(layer_types) if kind == "dense")
    else:
        first_dense = d.get("first_k_dense_replace")
        dense = tuple(range(int(_MLA_FIRST_DENSE[architecture] if first_dense is None else first_dense)))
    experts, groups = int(d.get("n_routed_experts") or 0), int(d.get("n_group") or 1)
    topk_groups = int(d.get("topk_group") or 1)
    if experts and (experts % groups or not 0 < topk_groups <= groups):
        raise CheckpointError(f"config.json: n_group {groups} must divide n_routed_experts {experts} and topk_group "
                              f"{topk_groups} lie in [1, n_group]")
    return dict(mlp_only_layers=dense, norm_topk_prob=bool(d.get("norm_topk_prob", True)), expert_scoring="sigmoid", expert_groups=groups,
                topk_groups=topk_groups, routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                shared_expert_intermediate_size=int(d.get("moe_intermediate_size") or 0)
                * int(d.get("n_shared_experts") or 0))


def _text_config(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """A hybrid vision-language checkpoint's config.json nests the text model under ``text_config``: that, with
    the keys transformers reads from the top level, is the model the engine runs (the vision tower is not)."""
    text = d.get("text_config")
    if architecture not in _HYBRID_MOE_LAYOUT or not isinstance(text, dict):
        return d
    merged = dict(text)
    for key in _TOP_LEVEL_KEYS:
        if key in d:
            merged[key] = d[key]
    for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id"):
        if merged.get(key) is None and d.get(key) is not None:
            merged[key] = d[key]
    return merged


def _hybrid(architecture: str, d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 (-MoE): the layer kinds (``layer_types``, else every ``full_attention_interval``-th
    layer full attention), the gated DeltaNet's sizes, partial rotary and the MoE layout (``_HYBRID_MOE_LAYOUT``).

    RoPE: Qwen3.5 configs carry ``mrope_section`` (multimodal RoPE: the rotary frequencies split into temporal /
    height / width sections, each rotated by its own position id). For text, transformers gives all three
    sections the same 1-D position (``Qwen3_5TextModel.forward`` expands 2-D position ids to identical rows, and
    ``Qwen3_5Model.compute_3d_position_ids`` leaves them None without image / video grids), so the recomposed
    cos / sin are plain RoPE over ``rotary_dim``: the mrope keys are dropped here."""
    layout = _HYBRID_MOE_LAYOUT.get(architecture)
    if layout is None:
        return {}
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = int(d.get("full_attention_interval") or 4)
        if interval <= 0:
            raise CheckpointError(f"config.json: full_attention_interval must be positive, got {interval}")
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(f"config.json: layer_types names {len(layer_types)} layers, num_hidden_layers is "
                              f"{num_layers}")
    for i, kind in enumerate(layer_types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise CheckpointError(f"config.json: layer_types[{i}] {kind!r} is not supported (only "
                                  f"{LINEAR_ATTENTION!r} / {FULL_ATTENTION!r})")
    sizes = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4)  # transformers' defaults
    sizes = {k: int(d[k]) if d.get(k) is not None else v for k, v in sizes.items()}
    for name, size in sizes.items():
        if size <= 0:
            raise CheckpointError(f"config.json: {name} must be positive, got {size}")
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise CheckpointError(f"config.json: linear_num_value_heads {sizes['linear_num_value_heads']} is not a "
                              f"multiple of linear_num_key_heads {sizes['linear_num_key_heads']}")
    recurrent_dtype = str(d.get("mamba_ssm_dtype") or "float32").removeprefix("torch.")
    if recurrent_dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"config.json: mamba_ssm_dtype {recurrent_dtype!r} is not supported")
    linear = LinearAttentionConfig(layer_types=tuple(layer_types), recurrent_dtype=recurrent_dtype, **sizes)

    rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    factor = rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    factor = 0.25 if factor is None else float(factor)  # transformers' default for these configs
    num_heads = int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or 256)
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2:
        raise CheckpointError(f"config.json: partial_rotary_factor {factor} must give an even rotary dim in "
                              f"(0, head_dim {head_dim}], got {rotary_dim}")
    if rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_scaling.items()
                        if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    fields: dict[str, Any] = dict(linear=linear, partial_rotary_factor=factor, head_dim=head_dim,
                                  rope_scaling=rope_scaling, qk_norm=True, num_kv_heads=int(
                                      d.get("num_key_value_heads") or num_heads))
    if layout == "dense":
        fields.update(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0)
    elif layout == "sparse":
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
    else:
        fields.update(norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    return fields


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
