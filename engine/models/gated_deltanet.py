"""Hybrid linear-attention decoders (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): gated DeltaNet layers and gated full
attention layers, per ``ModelConfig.linear.layer_types``. Read from transformers' ``modeling_qwen3_next.py``,
``modeling_qwen3_5.py`` and ``modeling_qwen3_5_moe.py``.

* Linear attention (``GatedDeltaNet``): one projection gives q, k (``linear_num_key_heads``), v and the output gate
  z (``linear_num_value_heads``), and per value head b (-> beta = sigmoid(b)) and a (-> the log decay
  g = -exp(A_log) * softplus(a + dt_bias)). q, k and v pass a short causal depthwise conv (SiLU), then the gated
  delta rule (``agentrt_kernels.torch_ref.gated_delta``) with L2-normed q / k; its output is RMS-normed per head,
  gated by SiLU(z), and projected out. Per request the layer continues from the state the runner hands it
  (``LayerRunner.linear_state``: the conv's last inputs and the recurrent matrix) and hands back the state after
  the step, so a prompt prefilled in several chunks computes what one pass does.
* Full attention (``GatedAttention``): q_proj gives, per head, the query and then an output gate; q and k get a
  per-head RMSNorm, RoPE rotates their first ``rotary_dim`` channels (partial rotary), and the attention output
  is multiplied by sigmoid(gate) before o_proj.

Every RMSNorm except the DeltaNet's gated one is zero-centred: ``x_normed * (1 + weight)`` in fp32, then cast
(Qwen3NextRMSNorm). Only full-attention layers have a KV cache: they call ``runner.attention`` / ``end_layer``
with their ordinal among full-attention layers, and linear layers ask ``runner.linear_state`` with theirs.

Checkpoint names: Qwen3.5 stores ``linear_attn.in_proj_qkv`` (rows q | k | v), ``in_proj_z``, ``in_proj_b``,
``in_proj_a``; Qwen3-Next stores ``in_proj_qkvz`` and ``in_proj_ba`` grouped by key head (per key head: its q, its
k, then the v and z of its value heads; b then a of its value heads). Both load into one packed ``in_proj``
(rows q | k | v | z | b | a). A vision-language checkpoint's text model (``model.language_model.*``) loads as
``model.*``; its vision tower (``model.visual.*``) and multi-token-prediction layers (``mtp.*``) are skipped with
a log line each.

Tensor parallel: each rank holds a slice of the DeltaNet's key and value heads (a key head with its value heads)
and of the attention heads; the state the runner hands a layer is then that rank's heads.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.interface import LayerRunner
from engine.models.layers import RotaryEmbedding, copy_into, new_parameter
from engine.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_divisible,
)
from engine.parallel.state import current_group
from agentrt_kernels.ops import gated_delta_decode, gated_delta_prefill
from agentrt_kernels.torch_ref.gated_delta import causal_conv1d, causal_conv1d_step

log = logging.getLogger(__name__)

TEXT_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
# checkpoint projection of a DeltaNet -> the shard of the packed ``in_proj`` it fills
IN_PROJ_SHARDS = {"in_proj_qkv": "qkv", "in_proj_z": "z", "in_proj_b": "b", "in_proj_a": "a",
                  "in_proj_qkvz": "qkvz", "in_proj_ba": "ba"}
SPLIT_LAYOUT = ("qkv", "z", "b", "a")  # Qwen3.5
GROUPED_LAYOUT = ("qkvz", "ba")  # Qwen3-Next


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: normalize in fp32, scale by ``1 + weight`` in fp32, then cast to the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(size)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with ``residual``: (norm(x + residual), x + residual), like ``layers.RMSNorm``."""
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated: RMS-normalize in fp32, cast, scale by ``weight`` (not zero-centred), multiply by
    SiLU(gate) in fp32, cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; ``linear_idx``: its ordinal among the model's linear layers (its state)."""

    def __init__(self, config: ModelConfig, layer_idx: int, linear_idx: int, layout: tuple[str, ...]) -> None:
        super().__init__()
        lin = config.linear
        assert lin is not None
        self.tp = current_group()
        world = self.tp.world_size
        check_divisible("linear_num_key_heads", lin.linear_num_key_heads, world)
        self.layer_idx, self.linear_idx = layer_idx, linear_idx
        self.num_k_heads = lin.linear_num_key_heads // world  # this rank's
        self.num_v_heads = lin.linear_num_value_heads // world
        self.head_k_dim, self.head_v_dim = lin.linear_key_head_dim, lin.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = lin.linear_conv_kernel_dim
        # global sizes of the packed rows q | k | v | z | b | a
        self.part_sizes = (lin.key_dim, lin.key_dim, lin.value_dim, lin.value_dim, lin.linear_num_value_heads,
                           lin.linear_num_value_heads)
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, list(self.part_sizes))
        self.in_proj.weight.weight_loader = self.load_in_proj
        self.in_proj.weight.shard_ids = layout
        self.conv1d = nn.Module()
        self.conv1d.weight = new_parameter(self.conv_dim, 1, self.kernel)
        self.conv1d.weight.weight_loader = self.load_conv
        self.dt_bias = new_parameter(self.num_v_heads)
        self.A_log = new_parameter(self.num_v_heads)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self.load_per_value_head
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(lin.value_dim, config.hidden_size)

    # -- loading: every loader takes the whole checkpoint tensor and copies in this rank's rows

    def _rows(self, loaded: torch.Tensor, size: int, what: str) -> torch.Tensor:
        if loaded.dim() < 1 or loaded.shape[0] != size:
            raise CheckpointError(f"shape {tuple(loaded.shape)}: dim 0 is not the {what} size {size}")
        return loaded

    def load_in_proj(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        """Shard ids: Qwen3.5's "qkv" / "z" / "b" / "a", Qwen3-Next's key-head-grouped "qkvz" / "ba"."""
        sizes, hidden = self.part_sizes, param.shape[1]
        if shard_id == "qkv":
            parts = self._rows(loaded, sum(sizes[:3]), "q | k | v").split(sizes[:3], dim=0)
            first = 0
        elif shard_id in ("z", "b", "a"):
            first = {"z": 3, "b": 4, "a": 5}[shard_id]
            parts = (loaded,)
        elif shard_id == "qkvz":
            heads, dk = self.part_sizes[0] // self.head_k_dim, self.head_k_dim
            group_v = self.part_sizes[2] // heads  # the v (and z) rows of one key head's value heads
            grouped = self._rows(loaded, 2 * sizes[0] + 2 * sizes[2], "q | k | v | z").reshape(heads, -1, hidden)
            q, k, v, z = grouped.split([dk, dk, group_v, group_v], dim=1)
            parts, first = tuple(x.reshape(-1, hidden) for x in (q, k, v, z)), 0
        elif shard_id == "ba":
            heads = self.part_sizes[0] // self.head_k_dim
            grouped = self._rows(loaded, 2 * sizes[4], "b | a").reshape(heads, -1, hidden)
            b, a = grouped.split(grouped.shape[1] // 2, dim=1)
            parts, first = (b.reshape(-1, hidden), a.reshape(-1, hidden)), 4
        else:
            raise CheckpointError(f"unknown in_proj shard {shard_id!r}")
        for i, part in enumerate(parts):
            self.in_proj.load(param, part, first + i)

    def load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """conv1d.weight [conv_dim, 1, K], channels q | k | v: this rank's channels of each."""
        sizes = self.part_sizes[:3]
        parts = self._rows(loaded, sum(sizes), "conv").split(sizes, dim=0)
        local = []
        for part, size in zip(parts, sizes):
            offset, length = self.tp.shard(size)
            local.append(part.narrow(0, offset, length))
        copy_into(param.data, torch.cat(local, dim=0))

    def load_per_value_head(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        size = self.part_sizes[4]
        offset, length = self.tp.shard(size)
        copy_into(param.data, self._rows(loaded, size, "value heads").narrow(0, offset, length))

    # -- forward

    def forward(self, hidden: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed, z, b, a = self.in_proj(hidden).split([self.conv_dim, self.value_dim, nv, nv], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32, as transformers

        state = runner.linear_state(self.linear_idx)
        lens = list(state.query_lens)
        if sum(lens) != num_tokens:
            raise ValueError(f"linear_state query_lens {lens} do not sum to the step's {num_tokens} tokens")
        conv_in, rec_in = state.conv, state.recurrent
        weight = self.conv1d.weight[:, 0]  # [C, K]
        if all(n == 1 for n in lens):  # every request decodes one token: whole-batch ops, no host-built index
            # (what a decode CUDA graph captures: its rows and state slots come from static buffers)
            conv_out, conv_new = causal_conv1d_step(mixed, weight, conv_in)
            q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            core, rec_new = gated_delta_decode(q.view(num_tokens, nk, dk), k.view(num_tokens, nk, dk),
                                               v.view(num_tokens, nv, dv), g, beta, rec_in)
            state.store(conv_new, rec_new)
        else:
            core = self._mixed_step(mixed, g, beta, lens, conv_in, rec_in, weight, state)
        out = self.norm(core, z.reshape(num_tokens, nv, dv)).reshape(num_tokens, self.value_dim)
        return self.out_proj(out)

    def _mixed_step(self, mixed, g, beta, lens, conv_in, rec_in, weight, state) -> torch.Tensor:
        """A step with prompt segments: the one-token rows in one batched call, the longer segments in another,
        each request from its own state (a request with no tokens keeps it)."""
        num_tokens = mixed.shape[0]
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        conv_new, rec_new = conv_in.clone(), rec_in.float().clone()  # a request with no tokens keeps its state
        single = [i for i, n in enumerate(lens) if n == 1]
        multi = [i for i, n in enumerate(lens) if n > 1]

        # the causal conv: one batched step for the one-token requests (decode), a pass per longer segment
        conv_out = torch.empty_like(mixed)
        if single:
            idx = torch.tensor(single, dtype=torch.int64, device=mixed.device)
            rows = torch.tensor([starts[i] for i in single], dtype=torch.int64, device=mixed.device)
            out, new = causal_conv1d_step(mixed[rows], weight, conv_in[idx])
            conv_out[rows], conv_new[idx] = out, new.to(conv_new.dtype)
        for i in multi:
            s, e = starts[i], starts[i + 1]
            conv_out[s:e], new = causal_conv1d(mixed[s:e], weight, conv_in[i])
            conv_new[i] = new.to(conv_new.dtype)

        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(num_tokens, nk, dk), k.view(num_tokens, nk, dk), v.view(num_tokens, nv, dv)
        core = mixed.new_empty(num_tokens, nv, dv)
        if single:
            core[rows], new = gated_delta_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], rec_in[idx])
            rec_new[idx] = new
        if multi:  # every longer segment in one call (one launch on a GPU), each from its request's state
            seg = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in multi]).to(mixed.device)
            many = torch.tensor(multi, dtype=torch.int64, device=mixed.device)
            core[seg], rec_new[many] = gated_delta_prefill(q[seg], k[seg], v[seg], g[seg], beta[seg], rec_in[many],
                                                           [lens[i] for i in multi])
        state.store(conv_new, rec_new.to(rec_in.dtype))
        return core


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
        q = self.q_norm(q)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, d))
        q, k = rotary(positions, q, k)
        out = runner.attention(self.attn_idx, q, k, v.view(num_tokens, self.num_kv_heads, d))
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
