"""Tensor-parallel layers (Megatron-style), built in the group current at construction.

* ``ColumnParallelLinear``: the output features are split across ranks (no communication);
  ``MergedColumnParallelLinear`` packs several such projections of one input (gate/up, q/k/v), each one split
  on its own so rank r holds ``[part_0 of r, part_1 of r, ...]``; ``QKVParallelLinear`` splits whole heads.
* ``RowParallelLinear``: the input features are split; partial products are summed by an all-reduce (the
  bias is added once, after it). ``reduce_results=False`` leaves the sum to the caller.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary is split; the embedding sums the ranks'
  masked look-ups, the head gathers the ranks' logits.

Each parameter's ``weight_loader`` takes the whole Hugging Face tensor and copies in this rank's slice, so a
checkpoint loads unchanged at any world size; at world size 1 every layer is the plain one.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError, ConfigError
from engine.models.layers import copy_into, new_parameter
from engine.parallel.state import TPGroup, current_group


def check_divisible(what: str, size: int, world_size: int) -> None:
    if size % world_size:
        raise ConfigError(f"tensor_parallel_size {world_size} must divide {what} ({size})")


def _slice(loaded: torch.Tensor, dim: int, group: TPGroup, size: int) -> torch.Tensor:
    if loaded.shape[dim] != size:
        raise CheckpointError(f"dim {dim} of shape {tuple(loaded.shape)} is not the expected {size}")
    offset, length = group.shard(size)
    return loaded.narrow(dim, offset, length)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = current_group()
        check_divisible("the output size", output_size, self.tp.world_size)
        self.output_size = output_size
        local = output_size // self.tp.world_size
        self.weight = new_parameter(local, input_size)
        self.bias = new_parameter(local) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        copy_into(param.data, _slice(loaded, 0, self.tp, self.output_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections of one input packed along the output dim; checkpoint shard i fills this rank's part i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        for size in output_sizes:
            check_divisible("each packed output size", size, self.tp.world_size)
        self.output_sizes = tuple(output_sizes)
        self.local_sizes = tuple(s // self.tp.world_size for s in output_sizes)
        self.local_offsets = tuple(sum(self.local_sizes[:i]) for i in range(len(output_sizes)))
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = tuple(range(len(output_sizes)))

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # the whole packed tensor at once
            if loaded.shape[0] != self.output_size:
                raise CheckpointError(f"dim 0 of shape {tuple(loaded.shape)} is not the expected {self.output_size}")
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.load(param, part, i)
            return
        dst = param.data.narrow(0, self.local_offsets[shard_id], self.local_sizes[shard_id])
        copy_into(dst, _slice(loaded, 0, self.tp, self.output_sizes[shard_id]))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Packed q/k/v; rank r holds query heads and KV heads ``[r * H / N, (r + 1) * H / N)`` of each."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        world = current_group().world_size
        check_divisible("the number of attention heads", num_heads, world)
        check_divisible("the number of KV heads", num_kv_heads, world)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)
        self.num_local_heads, self.num_local_kv_heads = num_heads // world, num_kv_heads // world


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp = current_group()
        check_divisible("the input size", input_size, self.tp.world_size)
        self.input_size, self.reduce_results = input_size, reduce_results
        self.weight = new_parameter(output_size, input_size // self.tp.world_size)
        self.weight.weight_loader = self.load
        self.bias = new_parameter(output_size) if bias else None
        assert bias is False or reduce_results, "a bias is added after the reduction"

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        copy_into(param.data, _slice(loaded, 1, self.tp, self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
            if self.bias is not None:
                out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_group()
        check_divisible("the vocabulary size", vocab_size, self.tp.world_size)
        self.vocab_size = vocab_size
        self.vocab_start, local = self.tp.shard(vocab_size)
        self.weight = new_parameter(local, hidden_size)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None
        copy_into(param.data, _slice(loaded, 0, self.tp, self.vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary rows; ``forward`` returns the whole vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(hidden, self.weight), dim=-1)


def check_model_shards(config, world_size: int) -> None:
    """ConfigError unless ``world_size`` ranks can split the model (``config``: engine.model_config.ModelConfig)
    into equal shards: whole query and KV heads, vocabulary rows, MLP and expert intermediate slices."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive int, got {world_size!r}")
    if world_size == 1:
        return
    latent = config.mla is not None  # every rank holds the one latent row whole, and a slice of the heads
    if world_size > config.num_kv_heads and not latent:
        raise ConfigError(f"tensor_parallel_size {world_size} exceeds the model's {config.num_kv_heads} KV heads "
                          "(each rank holds whole KV heads)")
    sizes = [("the number of attention heads", config.num_heads), ("the vocabulary size", config.vocab_size),
             ("the MLP intermediate size", config.intermediate_size)]
    if not latent:
        sizes.append(("the number of KV heads", config.num_kv_heads))
    linear = getattr(config, "linear", None)
    if linear is not None:  # each rank a slice of the DeltaNet's key heads, each with its value heads
        sizes.append(("linear_num_key_heads", linear.linear_num_key_heads))
    if config.num_experts:
        sizes.append(("the expert intermediate size", config.moe_intermediate_size))
    if config.shared_expert_intermediate_size:
        sizes.append(("the shared expert intermediate size", config.shared_expert_intermediate_size))
    for what, size in sizes:
        check_divisible(what, size, world_size)
