"""The hybrid linear-attention part of ``ModelConfig`` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): which layers are gated
DeltaNet and which full attention, the DeltaNet's sizes and state shapes, partial rotary, the MoE layout each
architecture implies, and the text model nested in a vision-language checkpoint's config.json, read and checked
from config.json. ``engine.model_config`` combines them with the common fields."""

from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError

# Hybrid linear-attention architectures (gated DeltaNet + gated full attention), with their MoE layout: "dense" (every
# layer a SwiGLU MLP), "sparse" (every layer the softmax top-k MoE with a sigmoid-gated shared expert, top-k weights
# always renormalized), "config" (Qwen3-Next: the MoE block where num_experts / decoder_sparse_step / mlp_only_layers
# put it, norm_topk_prob defaulting to true). The ConditionalGeneration ones are the text model of a vision-language
# checkpoint: config.json nests it under ``text_config``.
HYBRID_MOE_LAYOUT = {
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
TOP_LEVEL_KEYS = ("architectures", "tie_word_embeddings", "quantization_config")


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


def text_config(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """A hybrid vision-language checkpoint's config.json nests the text model under ``text_config``: that, with
    the keys transformers reads from the top level, is the model the engine runs (the vision tower is not)."""
    text = d.get("text_config")
    if architecture not in HYBRID_MOE_LAYOUT or not isinstance(text, dict):
        return d
    merged = dict(text)
    for key in TOP_LEVEL_KEYS:
        if key in d:
            merged[key] = d[key]
    for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id"):
        if merged.get(key) is None and d.get(key) is not None:
            merged[key] = d[key]
    return merged


def hybrid_fields(architecture: str, d: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 (-MoE): the layer kinds (``layer_types``, else every ``full_attention_interval``-th
    layer full attention), the gated DeltaNet's sizes, partial rotary and the MoE layout (``HYBRID_MOE_LAYOUT``).

    RoPE: Qwen3.5 configs carry ``mrope_section`` (multimodal RoPE: the rotary frequencies split into temporal /
    height / width sections, each rotated by its own position id). For text, transformers gives all three
    sections the same 1-D position (``Qwen3_5TextModel.forward`` expands 2-D position ids to identical rows, and
    ``Qwen3_5Model.compute_3d_position_ids`` leaves them None without image / video grids), so the recomposed
    cos / sin are plain RoPE over ``rotary_dim``: the mrope keys are dropped here."""
    layout = HYBRID_MOE_LAYOUT.get(architecture)
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
