"""Decode windows: decode steps launched back to back on the device, whose tokens the host reads once.

``LLMEngine`` runs ``decode_steps`` decode steps back to back (one window) and reads their tokens once. With
``EngineConfig.overlap_decode`` (a window may then be a single step) it launches the next window of the same
requests, from the device-side tokens of the current one, before it reads the current one's tokens: the
host's work between windows (accepting tokens, detokenizing, the next launch) then runs while the device
computes instead of between its kernels. What the host learns from a window (a stop token, a stop string)
reaches the next window one window late: a request that stops in window N has window N + 1 computed for it
and dropped. Its KV writes land past the request's accepted length, where nothing reads them and later writes
of that slot (in stream order, after them) replace them, as the tail of a window after a mid-window stop
already does.

``DecodeWindows`` is that path of ``LLMEngine.step``: how long a window a step's plan may run (every request
decodes, with one method whose ``DecodeCapabilities.window`` allows it, and has the length and the pages left),
launching it, whether the next may be launched before the last is read, and taking a window's tokens in order
as single steps would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.contract.cache import CacheManager
from engine.contract.method import UNBOUNDED_WINDOW
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch, next_decode_step
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.parallel.state import TPGroup
from engine.request import Request
from engine.sampler import TopLogprobs, top_lists
from engine.scheduler import Scheduler, StepPlan
from engine.step_timing import StepTiming


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


def steps_left(req: Request, launched: int) -> int:
    """Decode steps ``req`` may still take after the ``launched`` ones whose tokens the host has not read: its
    ``max_tokens`` and ``max_model_len`` both bound them."""
    return min(req.params.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens) - launched


class DecodeWindows:
    """The engine's decode windows: sized from a plan, launched, and taken (see the module docstring)."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, cache: CacheManager, runner: ModelRunner,
                 outputs: OutputProcessor, tp: TPGroup, device: torch.device, overlap: bool):
        self.config = config
        self.scheduler = scheduler
        self.cache = cache
        self.runner = runner
        self.outputs = outputs
        self.tp = tp
        self.device = device
        self._overlap = overlap
        self.pending: DecodeWindow | None = None  # overlap_decode: the window launched, its tokens not taken

    @property
    def overlap(self) -> bool:
        """Whether a window is launched before the last one is read (``EngineConfig.overlap_decode``)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if self.in_flight():
            raise ConfigError("overlap_decode cannot change while a decode window is in flight")
        if on and self.tp.world_size > 1:
            raise ConfigError("overlap_decode needs tensor_parallel_size 1")
        self._overlap = bool(on)

    def in_flight(self) -> bool:
        """A window was launched and its tokens are still to be taken (by the next step)."""
        if self.pending is not None and all(r.is_finished for r in self.pending.requests):
            self.pending = None  # every request it ran for was aborted since: nothing to take from it
        return self.pending is not None

    def size(self, plan: StepPlan) -> int:
        """How many decode steps this plan runs as a window on the device (0: a plain step): at most
        ``config.decode_steps``, when every request decodes one token with the same method, whose hooks would do
        nothing on those steps (``DecodeCapabilities.window`` >= 2), on several ranks only greedy or seeded
        ones, and each has the length and the pages left for them (pages for the extra steps are allocated
        here); two steps at least, or one with ``overlap_decode`` (the next launched before it is read). Never
        for a request with a grammar: its next mask depends on the matcher state, which the host only learns by
        reading the token just sampled; nor for a chain turn on a storage whose tables cannot be cut (a hybrid's
        recurrent state would run past a stop found inside the window, and the chain keeps that state)."""
        k = self.config.decode_steps
        if (k == 1 and not self._overlap) or plan.preempted:
            return 0
        if any(req.grammar is not None for req in plan.requests):
            return 0
        if not self.cache.storage.cuts_tables and any(req.chain_id is not None for req in plan.requests):
            return 0  # a chain keeps its recurrent state: steps run past a stop could not be taken back
        if any(req.method is not plan.requests[0].method for req in plan.requests):
            return 0  # requests of several methods: each method's hooks see its own sub-batch, step by step
        for req, n in zip(plan.requests, plan.num_new_tokens):
            if n != 1 or req.num_computed_tokens < req.num_prompt_tokens:
                return 0
            if self.tp.world_size > 1 and not (req.params.is_greedy or req.params.seed is not None):
                return 0  # every rank must sample the same tokens on its own: unseeded draws differ
            window = req.method.decode_capabilities(req).window
            if window < 2:
                return 0  # its hooks act on the next step
            k = min(k, steps_left(req, 0), window)
        if k < (1 if self._overlap else 2) or not all(self.cache.allocate(req, k) for req in plan.requests):
            return 0  # pages some requests took ahead stay theirs: later steps use them
        return k

    def run(self, batch: ForwardBatch, k: int, host_s: tuple[float, float],
            t_launch: float) -> tuple[list[RequestOutput], StepTiming | None]:
        """Launch ``k`` steps of ``batch``; with ``overlap_decode`` keep the window for the next step (no outputs
        yet), else take it now. ``host_s``: the step's schedule and prepare times; ``t_launch``: when it began
        launching. Returns the outputs and the step's timing (None when nothing was taken)."""
        window = self.launch(batch, k)
        if self._overlap:
            self.pending = window
            return [], None  # its tokens come with the next step
        return self.take(window, host_s, time.perf_counter() - t_launch)

    def launch(self, batch: ForwardBatch, k: int, ahead: int = 0) -> DecodeWindow:
        steps, last = self.runner.execute_decode_steps(batch, k, ahead)
        tokens, logprobs, top, ready = launch_copies(steps)
        return DecodeWindow(list(batch.sample_requests), k, tokens, logprobs, top, ready, last, steps[-1][0],
                            self.runner.last_replayed)

    def next_size(self, window: DecodeWindow) -> int:
        """Decode steps the window after ``window`` may run before the host has read ``window`` (0: none):
        its requests are the running ones and nothing waits to be admitted, each request's window is unbounded
        (nothing the host learns from ``window`` changes it), each request has the length left, and pages are
        allocated here."""
        reqs = window.requests
        if not self.cache.storage.cuts_tables and any(req.chain_id is not None for req in reqs):
            return 0  # as in ``size``: a chain's recurrent state must not run past a stop
        running = {id(r) for r in self.scheduler.running}
        if self.scheduler.waiting or len(running) != len(reqs) or not all(id(r) in running for r in reqs):
            return 0
        done = window.k
        k = self.config.decode_steps
        for req in reqs:
            if req.method.decode_capabilities(req).window < UNBOUNDED_WINDOW:
                return 0
            k = min(k, steps_left(req, done))
        if k < 1 or not all(self.cache.allocate(req, done + k) for req in reqs):
            return 0
        return k

    def take_launching_the_next(self) -> tuple[list[RequestOutput], StepTiming]:
        """Take the window in flight, having first launched the one after it where ``next_size`` allows."""
        window, self.pending = self.pending, None
        t0 = time.perf_counter()
        k = self.next_size(window)
        t1 = t2 = time.perf_counter()
        if k:
            batch = next_decode_step(window.last_batch, window.last_tokens, self.cache.block_tables(window.requests))
            t2 = time.perf_counter()
            self.pending = self.launch(batch, k, ahead=window.k)
        try:
            return self.take(window, (t1 - t0, t2 - t1), time.perf_counter() - t2, overlapped=bool(k))
        except BaseException:
            self.pending = None  # it follows tokens the host did not take: the requests go on from the host's
            raise

    def take(self, window: DecodeWindow, host_s: tuple[float, float], launch_s: float,
             overlapped: bool = False) -> tuple[list[RequestOutput], StepTiming]:
        """Wait for ``window``'s tokens, then take them in order as single steps would: a request that stops
        (or reaches its length) at step ``j`` keeps nothing after it; one that finished (or was aborted)
        before the window was read takes nothing from it. One output per request that took tokens."""
        t_wait = time.perf_counter()
        tokens, logprobs, tops = window.wait()  # the window's one wait for the device
        if self.tp.world_size > 1:  # the ranks sampled alike (greedy / seeded); take rank 0's to be sure
            flat = self.tp.broadcast_ints([t for row in tokens for t in row], self.device)
            tokens = [flat[j * len(row):(j + 1) * len(row)] for j, row in enumerate(tokens)]
        t3 = time.perf_counter()
        reqs = window.requests
        live = [i for i, req in enumerate(reqs) if not req.is_finished]
        taken: dict[str, list[int]] = {reqs[i].request_id: [] for i in live}
        text_before = {reqs[i].request_id: self.outputs.text_length(reqs[i]) for i in live}
        stops: dict[str, str | int | None] = {}
        taking = [reqs[i] for i in live]
        for j in range(window.k):
            if not live:
                break
            self.scheduler.update(StepPlan([reqs[i] for i in live], [1] * len(live)))
            for i in live:
                req = reqs[i]
                lp = logprobs[j][i] if req.params.logprobs else None
                stops[req.request_id] = self.outputs.accept_token(req, tokens[j][i], lp, tops[j][i])
                taken[req.request_id].append(tokens[j][i])
            live = [i for i in live if not reqs[i].is_finished]
        outputs = [self.outputs.emit(req, taken[req.request_id], text_before[req.request_id],
                                     stops.get(req.request_id)) for req in taking]
        timing = StepTiming(len(reqs), len(reqs), host_s[0], host_s[1], launch_s + t3 - t_wait,
                            time.perf_counter() - t3, decode_steps=window.k, replayed=window.replayed,
                            overlapped=overlapped)
        return outputs, timing
