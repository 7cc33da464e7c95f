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
from engine.sampler import TopLogprobs, top_lists


@dataclass(slots=True)
class DecodeWindow:
    """``k`` decode steps of ``requests`` (one row each, in order), launched; the host has not taken them."""

    requests: list[Request]
    k: int
    tokens: torch.Tensor  # [k, B] int64: a host copy, filled once ``ready`` has passed
    logprobs: torch.Tensor | None  # [k, B] fp32 (host copy), or None when no row asks for them
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([k, m, K] fp32, [k, m, K] int64) host copies of the
    # m rows asking for top logprobs (``Sampler.sample_tensors``), or None when none asks
    ready: torch.cuda.Event | None  # recorded after the copies (None on the CPU: already done)
    last_batch: ForwardBatch  # the batch of the window's last step: the next window continues from it
    last_tokens: torch.Tensor  # [B] int64 on the device: what the last step sampled
    replayed: bool  # every step replayed a decode CUDA graph

    def wait(self) -> tuple[list[list[int]], list[list[float | None]], list[list[TopLogprobs | None]]]:
        """Block until the window's tokens are on the host: (tokens [k][B], logprobs [k][B] or Nones, top
        logprobs [k][B], None for the rows that do not ask)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens.tolist()
        nones = [[None] * len(self.requests)] * self.k
        if self.logprobs is None:
            return tokens, nones, nones
        if self.top is None:
            return tokens, self.logprobs.tolist(), nones
        params = [r.params for r in self.requests]
        top = [top_lists(values, ids, params) for values, ids in zip(self.top[0].tolist(), self.top[1].tolist())]
        return tokens, self.logprobs.tolist(), top


def launch_copies(steps: list[tuple]) -> tuple:
    """Stack the steps' ``Sampler.sample_tensors`` results (tokens, logprobs, top) and start their copy to the
    host without waiting for it: (tokens, logprobs or None, top or None, an event that passes once all are on
    the host, or None on the CPU). Every step has the same rows, so the same fields are None."""
    tokens = torch.stack([s[0] for s in steps])
    logprobs = None if steps[0][1] is None else torch.stack([s[1] for s in steps])
    top = None if steps[0][2] is None else (torch.stack([s[2][0] for s in steps]),
                                            torch.stack([s[2][1] for s in steps]))
    if tokens.device.type != "cuda":
        return tokens, logprobs, top, None

    def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    host_tokens, host_logprobs = to_host(tokens), to_host(logprobs)
    host_top = None if top is None else (to_host(top[0]), to_host(top[1]))
    ready = torch.cuda.Event()
    ready.record()
    return host_tokens, host_logprobs, host_top, ready
