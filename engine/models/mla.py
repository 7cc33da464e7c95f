"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) in the absorbed form.

Per token the layer caches one latent row: ``kv_lora_rank`` normed latent values, then ``qk_rope_head_dim``
rotated key values shared by every head (``ModelConfig.mla.cache_dim`` values, one "KV head"). Head ``h``'s
key is ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c`` (``kv_b_proj`` holds ``W_UK`` and ``W_UV`` per head), so

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe     and     sum_s p_s W_UV[h] c_s = W_UV[h] sum_s p_s c_s.

The layer therefore hands the runner multi-query attention over the latent rows: query ``[W_UK^T q_nope, q_pe]``
(``cache_dim`` wide), key the whole row, value its first ``kv_lora_rank`` channels (a view of the key: nothing
is stored twice), and applies ``W_UV`` to the per-head result. Every sparse method and backend then scores and
reads the latent rows as one KV head. The runner scales logits by ``cache_dim ** -0.5`` (the engine's rule:
the query's last dim); MLA's softmax scale (``(nope + rope) ** -0.5``, with YaRN's mscale) is folded into the
query, so scores equal HF's exactly up to rounding.

Prompt chunks may instead attend over keys and values expanded per head (``engine.latent_expansion``, by
``EngineConfig.mla_prefill``: on a GPU, chunks long enough to pay for the expansion); methods still see the
absorbed queries and the latent rows. A runner without ``latent_attention`` gets the absorbed form throughout.
Tensor parallel: each rank holds a slice of the heads (``q_b_proj`` / ``kv_b_proj`` columns, ``o_proj`` rows);
the latent projection is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.latent_expansion import LatentExpansion
from engine.model_config import ModelConfig
from engine.models.interface import LayerRunner
from engine.models.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, check_divisible
from engine.parallel.state import current_group
from agentrt_kernels import ops

# HF builds the q / kv low-rank norms without the config's eps (DeepseekV3RMSNorm's default)
LOW_RANK_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.layer_idx, self.mla = layer_idx, mla
        world = current_group().world_size
        check_divisible("the number of attention heads", config.num_heads, world)
        self.num_heads = config.num_heads // world  # this rank's
        nope, rope, rank, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        bias = config.attention_bias
        qk_head = nope + rope
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_heads * qk_head)
            self.kv_a_proj_with_mqa = Linear(config.hidden_size, rank + rope, bias)
        else:  # q_a_proj and kv_a_proj_with_mqa (checkpoint names) read the same rows: one GEMM
            self.qkv_a_proj = MergedLinear(config.hidden_size, [mla.q_lora_rank, rank + rope], bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LOW_RANK_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, config.num_heads * qk_head)
        self.kv_a_layernorm = RMSNorm(rank, LOW_RANK_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(rank, config.num_heads * (nope + v))
        self.o_proj = RowParallelLinear(config.num_heads * v, config.hidden_size, bias)
        self.q_scale = mla.softmax_scale * mla.cache_dim**0.5  # the runner applies cache_dim ** -0.5

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]) of this rank's heads: views of ``kv_b_proj``."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]

    @property
    def input_proj(self) -> nn.Module | None:
        """The projection of the normed hidden rows that a fused decode path computes with the input norm
        (``DecoderLayer.forward_fused``): the merged q_a / kv_a projection; None without a low-rank query."""
        return getattr(self, "qkv_a_proj", None)

    def forward(self, hidden: torch.Tensor | None, positions: torch.Tensor, rotary: RotaryEmbedding,
                runner: LayerRunner, qkv: torch.Tensor | None = None, out_proj=None) -> torch.Tensor:
        """``qkv``: ``input_proj`` of the normed hidden, computed by the caller (then ``hidden`` is None);
        ``out_proj(x, weight, bias, norm=None)``: the decode projection (``ops.decode_linear``) in place of the
        layers' own for q_b (with q_a's norm inside it) and o_proj (``DecoderLayer.forward_fused``)."""
        mla, h = self.mla, self.num_heads
        if mla.q_lora_rank is None:
            q, kv = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        else:
            q_a, kv = (self.qkv_a_proj(hidden) if qkv is None else qkv).split([mla.q_lora_rank, mla.cache_dim],
                                                                             dim=-1)
            if out_proj is None:
                q = self.q_b_proj(self.q_a_layernorm(q_a))
            else:
                norm = self.q_a_layernorm
                q = out_proj(q_a, self.q_b_proj.weight, self.q_b_proj.bias, norm=(norm.weight, norm.eps))
        t = q.shape[0]
        q_nope, q_pe = q.view(t, h, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = ops.head_matmul(q_nope, w_uk)  # [T, H, rank]
        # the latent's norm, both rotations, the concatenations and the scale: one kernel on a GPU (with the
        # row's store where the runner stores rows itself)
        norm = self.kv_a_layernorm
        latent_attention = getattr(runner, "latent_attention", None)
        if latent_attention is not None:  # the runner stores the rows (in the same launch where it can)
            query, row, q_pe = runner.latent_inputs(self.layer_idx, q_latent, q_pe, kv, positions, rotary, norm,
                                                    self.q_scale, mla.rope_interleave, mla.kv_lora_rank)
        else:
            query, row, q_pe = ops.latent_inputs(q_latent, q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache,
                                                 norm.weight, norm.eps, self.q_scale, mla.rope_interleave)
        expansion = LatentExpansion(q_nope, q_pe, w_uk, w_uv, mla.softmax_scale)
        if latent_attention is not None:  # the runner may expand prompt chunks (engine.latent_expansion)
            out = latent_attention(self.layer_idx, query, row, mla.kv_lora_rank, expansion)  # [T, H, v]
        else:
            out = expansion.absorb(runner.attention(self.layer_idx, query, row, row[..., : mla.kv_lora_rank]))
        out = out.reshape(t, h * mla.v_head_dim)
        return self.o_proj(out) if out_proj is None else out_proj(out, self.o_proj.weight, self.o_proj.bias)
