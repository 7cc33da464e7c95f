"""The gated DeltaNet: the linear-attention layer of the hybrid decoders (``engine.models.gated_deltanet``), read
from transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``, with the checkpoint layouts of its input
projection.

One projection gives q, k (``linear_num_key_heads``), v and the output gate z (``linear_num_value_heads``), and per
value head b (-> beta = sigmoid(b)) and a (-> the log decay g = -exp(A_log) * softplus(a + dt_bias)). q, k and v
pass a short causal depthwise conv (SiLU), then the gated delta rule (``agentrt_kernels.ops``) with L2-normed q / k;
its output is RMS-normed per head (``GatedRMSNorm``, not zero-centred), gated by SiLU(z), and projected out. Per
request the layer continues from the state the runner hands it (``LayerRunner.linear_state``: the conv's last
inputs and the recurrent matrix) and hands back the state after the step, so a prompt prefilled in several chunks
computes what one pass does. A step where every request decodes one token runs whole-batch ops with no host-built
index (what a decode CUDA graph captures); a step with prompt segments batches its one-token rows and its longer
segments separately.

Checkpoint names: Qwen3.5 stores ``linear_attn.in_proj_qkv`` (rows q | k | v), ``in_proj_z``, ``in_proj_b``,
``in_proj_a`` (``SPLIT_LAYOUT``); Qwen3-Next stores ``in_proj_qkvz`` and ``in_proj_ba`` grouped by key head (per key
head: its q, its k, then the v and z of its value heads; b then a of its value heads; ``GROUPED_LAYOUT``). Both load
into one packed ``in_proj`` (rows q | k | v | z | b | a).

Tensor parallel: each rank holds a slice of the key and value heads (a key head with its value heads); the state
the runner hands the layer is then that rank's heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.interface import LayerRunner
from engine.models.layers import copy_into, new_parameter
from engine.parallel.layers import MergedColumnParallelLinear, RowParallelLinear, check_divisible
from engine.parallel.state import current_group
from agentrt_kernels.ops import causal_conv1d_update, gated_delta_prefill, gated_delta_step, gated_rms_norm
from agentrt_kernels.torch_ref.gated_delta import causal_conv1d, gated_delta_gates

# checkpoint projection of a DeltaNet -> the shard of the packed ``in_proj`` it fills
IN_PROJ_SHARDS = {"in_proj_qkv": "qkv", "in_proj_z": "z", "in_proj_b": "b", "in_proj_a": "a",
                  "in_proj_qkvz": "qkvz", "in_proj_ba": "ba"}
SPLIT_LAYOUT = ("qkv", "z", "b", "a")  # Qwen3.5
GROUPED_LAYOUT = ("qkvz", "ba")  # Qwen3-Next


class GatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated: RMS-normalize in fp32, cast, scale by ``weight`` (not zero-centred), multiply by
    SiLU(gate) in fp32, cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)  # one kernel on a GPU


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

        state = runner.linear_state(self.linear_idx)
        lens = list(state.query_lens)
        if sum(lens) != num_tokens:
            raise ValueError(f"linear_state query_lens {lens} do not sum to the step's {num_tokens} tokens")
        weight = self.conv1d.weight[:, 0]  # [C, K]
        if all(n == 1 for n in lens):  # every request decodes one token: whole-batch ops, no host-built index
            # (what a decode CUDA graph captures: its rows and state slots come from static buffers); the
            # states are read at their slots and written over in place, the gates computed inside the step
            conv_out = causal_conv1d_update(mixed, weight, state.conv_buffer, state.slots)
            q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            core = gated_delta_step(q.view(num_tokens, nk, dk), k.view(num_tokens, nk, dk), v.view(num_tokens, nv, dv),
                                    a, b, self.A_log, self.dt_bias, state.recurrent_buffer, state.slots)
        else:
            core = self._mixed_step(mixed, a, b, lens, weight, state)
        out = self.norm(core, z.reshape(num_tokens, nv, dv)).reshape(num_tokens, self.value_dim)
        return self.out_proj(out)

    def _mixed_step(self, mixed, a, b, lens, weight, state) -> torch.Tensor:
        """A step with prompt segments: the one-token rows through the in-place decode ops at their slots, the
        longer segments' states gathered, run in one call and stored back; a request with no tokens keeps its
        state untouched."""
        num_tokens = mixed.shape[0]
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        single = [i for i, n in enumerate(lens) if n == 1]
        multi = [i for i, n in enumerate(lens) if n > 1]
        dev = mixed.device
        if single:
            rows = torch.tensor([starts[i] for i in single], dtype=torch.int64, device=dev)
            single_slots = state.slots[torch.tensor(single, dtype=torch.int64, device=dev)]
        if multi:
            multi_slots = state.slots[torch.tensor(multi, dtype=torch.int64, device=dev)]

        # the causal conv: the one-token rows in one in-place step, a pass per longer segment
        conv_out = torch.empty_like(mixed)
        if single:
            conv_out[rows] = causal_conv1d_update(mixed[rows], weight, state.conv_buffer, single_slots)
        if multi:
            conv_in = state.conv_buffer[multi_slots]
            conv_new = torch.empty_like(conv_in)
            for j, i in enumerate(multi):
                s, e = starts[i], starts[i + 1]
                conv_out[s:e], new = causal_conv1d(mixed[s:e], weight, conv_in[j])
                conv_new[j] = new.to(conv_new.dtype)
            state.conv_buffer[multi_slots] = conv_new

        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(num_tokens, nk, dk), k.view(num_tokens, nk, dk), v.view(num_tokens, nv, dv)
        core = mixed.new_empty(num_tokens, nv, dv)
        if single:
            core[rows] = gated_delta_step(q[rows], k[rows], v[rows], a[rows], b[rows], self.A_log, self.dt_bias,
                                          state.recurrent_buffer, single_slots)
        if multi:  # every longer segment in one call (one launch on a GPU), each from its request's state
            g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
            seg = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in multi]).to(dev)
            core[seg], rec_new = gated_delta_prefill(q[seg], k[seg], v[seg], g[seg], beta[seg],
                                                     state.recurrent_buffer[multi_slots], [lens[i] for i in multi])
            state.recurrent_buffer[multi_slots] = rec_new.to(state.recurrent_buffer.dtype)
        return core
