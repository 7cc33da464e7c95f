"""Attention backends: who computes attention over a view, on which device.

A backend declares the view types it reads; ``check_supports`` fails at configuration time, never mid-step.
``auto`` picks the fastest backend available on the device and logs which.
"""

from __future__ import annotations

import logging

import torch

from engine.contract.view import PagedView
from engine.errors import ConfigError

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "triton", "flashinfer")


class TorchReferenceBackend:
    name = "torch"
    accepted_views: tuple[type, ...] = (PagedView,)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        view: PagedView,
        scale: float,
        return_scores: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        from kernels.torch_ref import paged_attention

        return paged_attention(
            q, k_cache, v_cache, view.block_tables, view.kv_lens_cpu, view.query_lens_cpu,
            scale, causal=view.causal, return_scores=return_scores,
        )

    def check_supports(self, view_types: tuple[type, ...]) -> list[str]:
        return [f"{self.name} backend cannot read {t.__name__}" for t in view_types
                if not issubclass(t, self.accepted_views)]


def make_backend(name: str, device: torch.device) -> TorchReferenceBackend:
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name in ("triton", "flashinfer"):
        raise ConfigError(f"attention_backend {name!r} is not built into this version; use 'torch' or 'auto'")
    backend = TorchReferenceBackend()
    if name == "auto":
        log.info("attention backend: %s (auto on %s)", backend.name, device)
    return backend
