"""A decode window in flight: its steps are launched on the device, its tokens not yet read by the host.

``LLMEngine`` runs ``decode_steps`` decode steps back to back (one window) and reads their tokens once. With
``EngineConfig.overlap_decode`` (a window may then be a single step) it launches the next window of the same
requests, from the device-side tokens of the current one, before it reads the current one's tokens: the
host's work between windows (accepting tokens, detokenizing, the next launch) then runs while the device
computes instead of between its kernels. What the host learns from a window (a stop token, a stop string) reaches the next window one
window late: a request that stops in window N has window N + 1 computed for it and dropped. Its KV writes
land past the request's accepted length, where nothing reads them and later writes of that slot (in stream
order, after them) replace them, as the tail of a window after a mid-window stop already does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.request import Request


@dataclass(slots=True)
class DecodeWindow:
    """``k`` decode steps of ``requests`` (one row each, in order), launched; the host has not taken them."""

    requests: list[Request]
    k: int
    tokens: torch.Tensor  # [k, B] int64: a host copy, filled once ``ready`` has passed
    logprobs: torch.Tensor | None  # [k, B] fp32 (host copy), or None when no row asks for them
    ready: torch.cuda.Event | None  # recorded after the copies (None on the CPU: already done)
    last_batch: ForwardBatch  # the batch of the window's last step: the next window continues from it
    last_tokens: torch.Tensor  # [B] int64 on the device: what the last step sampled
    replayed: bool  # every step replayed a decode CUDA graph

    def wait(self) -> tuple[list[list[int]], list[list[float | None]]]:
        """Block until the window's tokens are on the host: (tokens [k][B], logprobs [k][B] or Nones)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens.tolist()
        if self.logprobs is None:
            return tokens, [[None] * len(self.requests)] * self.k
        return tokens, self.logprobs.tolist()


def launch_copies(steps: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple:
    """Stack the steps' (tokens, logprobs) and start their copy to the host without waiting for it:
    (tokens, logprobs or None, an event that passes once both are on the host, or None on the CPU)."""
    tokens = torch.stack([t for t, _ in steps])
    logprobs = None if steps[0][1] is None else torch.stack([lp for _, lp in steps])
    if tokens.device.type != "cuda":
        return tokens, logprobs, None
    host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host_tokens.copy_(tokens, non_blocking=True)
    host_logprobs = None
    if logprobs is not None:
        host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host_tokens, host_logprobs, ready
