"""What model code may assume about the engine, and what the engine assumes about model code.

Model code never sees pages, requests or methods. Each decoder layer hands its projected, rotated
q/k/v to ``LayerRunner.attention`` (or, to a runner that has ``attention_rotary``, q/k before RoPE and the
rotary module) and calls ``LayerRunner.end_layer`` when the layer is done; the engine's runner implements
them on top of the lifecycle contract.
"""

from typing import Iterable, Protocol

import torch


class LayerRunner(Protocol):
    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], RoPE (and q/k norm) applied.

        T is the number of tokens in the step (all requests flattened). Returns [T, num_heads, head_dim].
        """
        ...

    # Optional: a runner with ``attention_rotary(layer_idx, q, k, v, positions, rotary, qk_norm=None)`` gets q/k
    # before RoPE and the model's ``rotary`` module (``rotary(positions, q, k) -> (q, k)``, with ``cos_cache`` /
    # ``sin_cache``), so it can rotate while it stores; it returns what ``attention`` would. A model with per-head
    # q/k norms passes them unapplied as ``qk_norm=(q_norm, k_norm)`` (RMSNorm modules: ``weight`` [D], ``eps``).
    # Optional too: ``latent_attention(layer_idx, q, row, value_dim, expansion)`` for a latent (MLA) layer, which
    # returns the per-head output after ``W_UV`` ([T, num_heads, v]) and may run prompt chunks over expanded keys
    # and values (``engine.latent_expansion.LatentExpansion``); without it the layer calls ``attention`` absorbed.
    # A runner with it also has ``latent_inputs(layer_idx, q_latent, q_pe, kv, positions, rotary, norm, scale,
    # interleave, value_dim)``, called first: ``ops.latent_inputs``' (query, row, q_pe), the rows stored by it.

    def end_layer(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """Called after layer ``layer_idx`` with its output hidden states [T, hidden_size].

        A runner with ``wants_layer_output = False`` is not called, and the model need not form the sum.
        """
        ...


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, runner: LayerRunner) -> torch.Tensor:
        """input_ids, positions: [T] int64 (positions are logical). Returns final-normed hidden [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] float32."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF checkpoint name, tensor) pairs; raise CheckpointError on missing/unknown/misshaped."""
        ...
