"""The pre-norm decoder shared by Llama / Qwen2 / Qwen3 / Qwen3-MoE, switched by ModelConfig flags.

Module names mirror HF's (``model.layers.{i}.self_attn...``) except for the packed projections
(``qkv_proj``, ``gate_up_proj``), which ``packed_modules_mapping`` maps checkpoint names onto.
"""

from typing import Any, Iterable

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.interface import LayerRunner
from engine.models.layers import RMSNorm, RotaryEmbedding, default_weight_loader, silu_and_mul
from engine.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from agentrt_kernels import ops

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DenseMLP(nn.Module):
    """SwiGLU MLP; each tensor-parallel rank holds a slice of the intermediate dim. ``reduce_results=False``
    returns this rank's partial sum (the caller reduces it with others)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Attention over this tensor-parallel rank's query and KV heads (all of them at world size 1)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_heads, config.num_kv_heads,
                                          config.head_dim, config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_local_heads, self.qkv_proj.num_local_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = list(self.qkv_proj.local_sizes)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    @property
    def input_proj(self) -> nn.Module:
        """The projection of the normed hidden rows that ``DecoderLayer.forward_fused`` computes with the input
        norm: the packed q / k / v."""
        return self.qkv_proj

    def forward(
        self, hidden: torch.Tensor | None, positions: torch.Tensor, rotary: RotaryEmbedding, runner: LayerRunner,
        qkv: torch.Tensor | None = None, out_proj=None,
    ) -> torch.Tensor:
        """``qkv``: the packed projection of the normed hidden, computed by the caller (then ``hidden`` is None);
        ``out_proj(x, weight, bias)``: the output projection in place of ``o_proj``'s own (DecoderLayer.forward_fused)."""
        qkv = self.qkv_proj(hidden) if qkv is None else qkv
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attention_rotary = getattr(runner, "attention_rotary", None)
        if attention_rotary is not None:  # the runner applies q/k norms and RoPE itself (fused with its store)
            norm = {} if self.q_norm is None else {"qk_norm": (self.q_norm, self.k_norm)}
            out = attention_rotary(self.layer_idx, q, k, v, positions, rotary, **norm)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k)
            out = runner.attention(self.layer_idx, q, k, v)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out) if out_proj is None else out_proj(out, self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module, attention: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        rotary: RotaryEmbedding, runner: LayerRunner,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual): the layer's output is their sum, left to the next norm to add."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attn = self.self_attn(normed, positions, rotary, runner)
        after_norm = getattr(self.mlp, "forward_after_norm", None)
        if after_norm is not None:  # an MLP that runs the norm inside its own first launch
            return after_norm(attn, residual, self.post_attention_layernorm)
        normed, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed), residual

    def forward_fused(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        rotary: RotaryEmbedding, runner: LayerRunner,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a few rows (decode) with each norm fused into the projection after it (under a MoE
        block: its router's, which hands the normed rows on to the experts; an MLP with ``forward_after_norm``
        runs the norm in its own first launch), and SiLU-and-mul into the down projection
        (agentrt_kernels.ops.decode_linear): three launches fewer a dense layer, two a MoE one. The output
        projection runs through decode_linear too (no prologue: its launch where it measured faster than cuBLAS,
        cuBLAS where not); latent attention also runs q_b with q_a's norm through it (``LatentAttention``)."""
        decode_linear = ops.decode_linear
        ln, qkv_proj = self.input_layernorm, self.self_attn.input_proj
        if residual is None:
            qkv, residual = decode_linear(hidden, qkv_proj.weight, qkv_proj.bias, norm=(ln.weight, ln.eps)), hidden
        else:
            qkv, residual = decode_linear(hidden, qkv_proj.weight, qkv_proj.bias, norm=(ln.weight, ln.eps),
                                          residual=residual)
        attn = self.self_attn(None, positions, rotary, runner, qkv=qkv, out_proj=decode_linear)
        post, mlp = self.post_attention_layernorm, self.mlp
        after_norm = getattr(mlp, "forward_after_norm", None)
        if after_norm is not None:  # an MLP that runs the norm inside its own first launch (its router's)
            return after_norm(attn, residual, post)
        if not isinstance(mlp, DenseMLP):  # a sparse MoE block (engine.models.moe)
            logits, residual, normed = decode_linear(attn, mlp.gate.weight, mlp.gate.bias, norm=(post.weight, post.eps),
                                                     residual=residual, return_normed=True)
            return mlp(normed, router_logits=logits), residual
        gate_up, residual = decode_linear(attn, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                          norm=(post.weight, post.eps), residual=residual)
        return decode_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, silu_mul=True), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, mlps: list[nn.Module], attentions: list[nn.Module],
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, mlp, attention)
                                    for i, (mlp, attention) in enumerate(zip(mlps, attentions)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary
        # DecoderLayer.forward_fused for steps of at most this many tokens (0: never); set by the engine
        # (EngineConfig.fused_decode_linears) at one tensor-parallel rank
        self.fused_decode_rows = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        wants_output = runner.wants_layer_output
        fused = 0 < input_ids.shape[0] <= self.fused_decode_rows
        for layer in self.layers:
            forward = layer.forward_fused if fused else layer
            hidden, residual = forward(hidden, residual, positions, self.rotary_emb, runner)
            if wants_output:
                runner.end_layer(layer.layer_idx, hidden + residual)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """CausalLM over DecoderModel; subclasses choose the per-layer attention and MLP, the rotary embedding and
    extra checkpoint name rules."""

    fused_decode_path = True  # DecoderLayer.forward_fused serves its layers (engine.decode_speedups)

    packed_modules_mapping: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layers = range(config.num_layers)
        self.model = DecoderModel(config, [self.make_mlp(config, i) for i in layers],
                                  [self.make_attention(config, i) for i in layers], self.make_rotary(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return DenseMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def make_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Attention(config, layer_idx)

    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def kv_projections(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, this rank's key and value projections as fp32 weights ``[Hkv, D, hidden]`` (``"k"``: with
        the per-head key norm's weight folded in, so every cached key before RoPE, less its bias, lies in its
        column space; ``"v"``) and biases ``[Hkv, D]`` (``"k_bias"``, ``"v_bias"``: None without), for storage
        derived from the weights (a low-rank basis)."""
        out = []
        for layer in self.model.layers:
            attn = layer.self_attn
            heads, d = attn.num_kv_heads, attn.head_dim
            _, k, v = attn.qkv_proj.weight.detach().float().split(attn.split_sizes, dim=0)
            k = k.view(heads, d, -1)
            if attn.k_norm is not None:
                k = k * attn.k_norm.weight.detach().float()[None, :, None]
            bias = attn.qkv_proj.bias
            kb = vb = None
            if bias is not None:
                _, kb, vb = bias.detach().float().split(attn.split_sizes)
                kb, vb = kb.view(heads, d), vb.view(heads, d)
            out.append({"k": k, "v": v.reshape(heads, d, -1), "k_bias": kb, "v_bias": vb})
        return out

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.model.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden [T, hidden_size] in the model dtype."""
        return self.model(input_ids, positions, runner)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """HF checkpoint tensor name -> (our parameter name, shard id or None for the whole parameter)."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                packed, shard_id = self.packed_modules_mapping[part]
                return ".".join([*parts[:i], packed, *parts[i + 1 :]]), shard_id
        return name, None

    def checkpoint_name(self, param_name: str, shard_id: Any) -> str:
        """Inverse of checkpoint_target, for error messages."""
        parts = param_name.split(".")
        for original, (packed, packed_shard) in self.packed_modules_mapping.items():
            if packed_shard == shard_id and packed in parts:
                return ".".join(original if p == packed else p for p in parts)
        return param_name if shard_id is None else f"{param_name}[shard {shard_id}]"

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        return name.endswith(_IGNORED_SUFFIXES) or (self.config.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the parameters; CheckpointError on unknown/misshaped/missing."""
        params = dict(self.named_parameters())
        pending = {name: set(getattr(p, "shard_ids", (None,))) for name, p in params.items()}
        for name, tensor in weights:
            if self.is_ignored_checkpoint_tensor(name):
                continue
            target, shard_id = self.checkpoint_target(name)
            param = params.get(target)
            if param is None:
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except CheckpointError as e:
                raise CheckpointError(f"tensor {name!r}: {e}") from None
            if shard_id is None:
                pending[target].clear()
            else:
                pending[target].discard(shard_id)
        missing = [self.checkpoint_name(n, s) for n, shards in pending.items() for s in sorted(shards, key=str)]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {shown}")
