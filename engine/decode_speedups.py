"""The decode speed-ups an engine turns on when it starts: fused decode linears and decode CUDA graphs.

Both are decided once, after the model is loaded. Fused decode linears (``EngineConfig.fused_decode_linears``)
run a small step's projections as Triton kernels (``DecoderLayer.forward_fused``); decode CUDA graphs
(``engine.cuda_graphs``) replay pure-decode steps without the host. Graphs are captured only where a replay can
be right: on a GPU, at one tensor-parallel rank, with a backend and a model forward that do no host work and a
method whose decode steps may replay (``DecodeCapabilities.replay``); the engine logs each reason against.
"""

from __future__ import annotations

import os

import torch

from engine.attention_backend import TorchReferenceBackend
from engine.config import EngineConfig
from engine.contract.method import SparseMethod
from engine.errors import ConfigError


def fuse_decode_linears(model: torch.nn.Module, architecture: str, device: torch.device, asked: bool) -> None:
    """Turn on the model's fused decode path; ``asked``: the configuration asked for it explicitly (ConfigError
    when the architecture has none), else (the default) architectures without one stay as they are."""
    decoder = getattr(model, "model", None)
    if not getattr(model, "fused_decode_path", False):
        if not asked:  # the default: the architectures that have the fused path
            return
        raise ConfigError(f"fused_decode_linears: {architecture} has no fused decode path")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("fused_decode_linears runs Triton kernels: a GPU, or TRITON_INTERPRET=1 on the CPU")
    from agentrt_kernels.triton.decode_linear import MAX_ROWS

    decoder.fused_decode_rows = MAX_ROWS


def reasons_against_graphs(config: EngineConfig, device: torch.device, backend: TorchReferenceBackend,
                           method: SparseMethod, world_size: int, model: torch.nn.Module,
                           architecture: str) -> list[str]:
    """Why this engine captures no decode CUDA graphs (empty: it captures them)."""
    reasons = []
    if device.type != "cuda":
        reasons.append("not on a GPU")
    if config.enforce_eager:
        reasons.append("enforce_eager")
    if not backend.cuda_graph_safe:
        reasons.append(f"backend {backend.name} is not graph-safe")
    if not method.decode.replay:
        reasons.append(f"method {method.name} does host work per layer")
    if world_size > 1:
        reasons.append("tensor parallel (collectives are not captured)")
    if not getattr(model, "cuda_graph_safe", True):
        reasons.append(f"{architecture} forward syncs with the host")
    return reasons
