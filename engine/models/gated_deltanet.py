"""Hybrid linear-attention decoders (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): gated DeltaNet layers and gated full
attention layers, per ``ModelConfig.linear.layer_types``. Read from transformers' ``modeling_qwen3_next.py``,
``modeling_qwen3_5.py`` and ``modeling_qwen3_5_moe.py``.

* Linear attention (``GatedDeltaNet``, ``engine.models.gated_deltanet_layer``): a gated delta rule over a causal
  conv of q, k and v, continuing each request from the state ``LayerRunner.linear_state`` hands it.
* Full attention (``GatedAttention``): q_proj gives, per head, the query and then an output gate; q and k get a
  per-head RMSNorm, RoPE rotates their first ``rotary_dim`` channels (partial rotary), and the attention output
  is multiplied by sigmoid(gate) before o_proj.

Every RMSNorm except the DeltaNet's gated one is zero-centred: ``x_normed * (1 + weight)`` in fp32, then cast
(Qwen3NextRMSNorm). Only full-attention layers have a KV cache: they call ``runner.attention`` / ``end_layer``
with their ordinal among full-attention layers, and linear layers ask ``runner.linear_state`` with theirs.

Checkpoint names: the DeltaNet's projections load into its packed ``in_proj`` (``IN_PROJ_SHARDS``; the layouts are
described in ``engine.models.gated_deltanet_layer``). A vision-language checkpoint's text model
(``model.language_model.*``) loads as ``model.*``; its vision tower (``model.visual.*``) and multi-token-prediction
layers (``mtp.*``) are skipped with a log line each.

Tensor parallel: each rank holds a slice of the DeltaNet's key and value heads (a key head with its value heads)
and of the attention heads; the state the runner hands a layer is then that rank's heads.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from agentrt_kernels import ops
from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.gated_deltanet_layer import (
    GROUPED_LAYOUT,
    IN_PROJ_SHARDS,
    SPLIT_LAYOUT,
    GatedDeltaNet,
    GatedRMSNorm,
)
from engine.models.interface import LayerRunner
from engine.models.layers import RotaryEmbedding, new_parameter
from engine.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_divisible,
)
from engine.parallel.state import current_group

# the DeltaNet's names are importable from here, where the hybrid models find them
__all__ = ["GROUPED_LAYOUT", "IN_PROJ_SHARDS", "SPLIT_LAYOUT", "GatedAttention", "GatedDeltaNet", "GatedRMSNorm",
           "HybridDecoderLayer", "HybridDecoderModel", "HybridForCausalLM", "ZeroCenteredRMSNorm"]

log = logging.getLogger(__name__)

TEXT_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: normalize in fp32, scale by ``1 + weight`` in fp32, then cast to the input dtype."""

    zero_centered = True  # the form a fused kernel taking this norm's weight must compute (ops.rms_norm)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(size)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with ``residual``: (norm(x + residual), x + residual), like ``layers.RMSNorm``; one fused
        kernel on a GPU."""
        return ops.rms_norm(x, self.weight, self.eps, residual, zero_centered=True)


class GatedAttention(nn.Module):
    """Full attention with the sigmoid output gate; ``attn_idx``: its ordinal among full-attention layers."""

    def __init__(self, config: ModelConfig, layer_idx: int, attn_idx: int) -> None:
        super().__init__()
        world = current_group().world_size
        check_divisible("the number of attention heads", config.num_heads, world)
        check_divisible("the number of KV heads", config.num_kv_heads, world)
        self.layer_idx, self.attn_idx = layer_idx, attn_idx
        d = self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_heads // world, config.num_kv_heads // world
        # per head the query, then its gate (transformers' q_proj of 2 * head_dim per head)
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.num_heads * 2 * d, config.num_kv_heads * d, config.num_kv_heads * d],
            config.attention_bias)
        self.split_sizes = list(self.qkv_proj.local_sizes)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, config.o_proj_bias)
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                runner: LayerRunner) -> torch.Tensor:
        num_tokens, d = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * d).chunk(2, dim=-1)
        k, v = k.view(num_tokens, self.num_kv_heads, d), v.view(num_tokens, self.num_kv_heads, d)
        attention_rotary = getattr(runner, "attention_rotary", None)
        if attention_rotary is not None:  # the runner applies the q/k norms and RoPE itself (fused with its store)
            out = attention_rotary(self.attn_idx, q, k, v, positions, rotary, qk_norm=(self.q_norm, self.k_norm))
        else:
            q, k = rotary(positions, self.q_norm(q), self.k_norm(k))
            out = runner.attention(self.attn_idx, q, k, v)
        out = out.reshape(num_tokens, self.num_heads * d) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        assert config.linear is not None
        self.layer_idx = layer_idx
        self.is_linear = config.linear.is_linear(layer_idx)
        self.kind_idx = config.linear.kind_index(layer_idx)  # attention / state ordinal
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        rotary: RotaryEmbedding, runner: LayerRunner,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual): the layer's output is their sum, left to the next norm to add."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            mixed = self.linear_attn(normed, runner)
        else:
            mixed = self.self_attn(normed, positions, rotary, runner)
        normed, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(normed), residual


class HybridDecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[HybridDecoderLayer], rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        wants_output = runner.wants_layer_output
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb, runner)
            if wants_output and not layer.is_linear:  # only KV layers end: their attention ordinal
                runner.end_layer(layer.kind_idx, hidden + residual)
        return self.norm(hidden, residual)[0]


class HybridForCausalLM(DecoderForCausalLM):
    """The hybrid decoder; subclasses pick the MLP (``make_mlp``) and the DeltaNet checkpoint layout."""

    fused_decode_path = False  # DecoderLayer.forward_fused serves the plain decoder only
    # a pure decode step runs the DeltaNet layers over the whole batch, their state slots read from a device
    # tensor (a decode graph's static buffer), so nothing in it depends on the host
    cuda_graph_safe = True
    checkpoint_layout: tuple[str, ...] = SPLIT_LAYOUT

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        if config.linear is None:
            raise CheckpointError(f"{config.architecture} needs layer_types (linear / full attention)")
        self.config = config
        layers = [HybridDecoderLayer(config, i, self.make_attention(config, i), self.make_mlp(config, i))
                  for i in range(config.num_layers)]
        self.model = HybridDecoderModel(config, layers, self.make_rotary(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        assert config.linear is not None
        kind_idx = config.linear.kind_index(layer_idx)
        if config.linear.is_linear(layer_idx):
            return GatedDeltaNet(config, layer_idx, kind_idx, self.checkpoint_layout)
        return GatedAttention(config, layer_idx, kind_idx)

    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings,
                               rotary_dim=config.rotary_dim)

    def kv_projections(self) -> list[dict[str, torch.Tensor]]:
        """``DecoderForCausalLM.kv_projections`` for the full-attention (KV) layers, in their order; the key norm
        folded in is the zero-centred one (``1 + weight``)."""
        out = []
        for layer in self.model.layers:
            if layer.is_linear:
                continue
            attn = layer.self_attn
            heads, d = attn.num_kv_heads, attn.head_dim
            _, k, v = attn.qkv_proj.weight.detach().float().split(attn.split_sizes, dim=0)
            k = k.view(heads, d, -1) * (1.0 + attn.k_norm.weight.detach().float())[None, :, None]
            bias = attn.qkv_proj.bias
            kb = vb = None
            if bias is not None:
                _, kb, vb = bias.detach().float().split(attn.split_sizes)
                kb, vb = kb.view(heads, d), vb.view(heads, d)
            out.append({"k": k, "v": v.reshape(heads, d, -1), "k_bias": kb, "v_bias": vb})
        return out

    # -- checkpoint names

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "linear_attn" and parts[-2] in IN_PROJ_SHARDS:
            return ".".join([*parts[:-2], "in_proj", parts[-1]]), IN_PROJ_SHARDS[parts[-2]]
        return super().checkpoint_target(name)

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        if param_name.endswith("linear_attn.in_proj.weight") and isinstance(shard_id, str):
            return param_name.replace("in_proj.weight", f"in_proj_{shard_id}.weight")
        return super().checkpoint_name(param_name, shard_id)

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        for prefix, what in ((VISION_PREFIX, "the vision tower"), (MTP_PREFIX, "multi-token prediction layers")):
            if name.startswith(prefix):
                logged = self.__dict__.setdefault("_logged_skips", set())
                if prefix not in logged:
                    log.info("skipping checkpoint tensors %s* (%s, not run)", prefix, what)
                    logged.add(prefix)
                return True
        return super().is_ignored_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``DecoderForCausalLM.load_weights``, with a vision-language checkpoint's ``model.language_model.*``
        read as ``model.*``."""
        def text_names():
            for name, tensor in weights:
                if name.startswith(TEXT_MODEL_PREFIX):
                    name = "model." + name[len(TEXT_MODEL_PREFIX):]
                yield name, tensor

        super().load_weights(text_names())
