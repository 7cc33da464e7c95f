"""LLMEngine: the step-level API the server drives (add a request, run one step, collect outputs, abort).

One step is ``schedule -> prepare -> execute -> update -> end_step -> append samples``; see
docs/architecture.md for who owns what. The engine runs the plain step; each other concern is a module of its
own: building its parts from an ``EngineConfig`` (``engine.engine_wiring``), pool sizing
(``engine.kv_pool_sizing``), decode graphs and fused linears (``engine.decode_speedups``), the methods it serves
(``engine.method_set``), a new request's checks (``engine.request_checks``), stop handling and outputs
(``engine.output_processor``), decode windows and their overlap (``engine.decode_window``), chains
(``engine.chain_manager``) and step timing (``engine.step_timing``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

from engine.chain_index import ChainInfo
from engine.chain_prune import PruneResult
from engine.config import EngineConfig
from engine.engine_wiring import load_tokenizer, wire_engine
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.parallel.workers import mirrored
from engine.registry import create_scorer
from engine.request import Request
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams
from engine.step_timing import StepTiming, prefill_tokens
from engine.structured_output import StructuredOutputs
from engine.warmup import warm_up

__all__ = ["LLMEngine", "StepTiming", "load_tokenizer"]  # the server and tools import these from here

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, _tp=None):
        """``_tp``: (group, link) when built as a tensor-parallel rank > 0 (engine.parallel.workers)."""
        self.config = config
        parts = wire_engine(config, self, _tp)
        self.device = parts.device
        self.method = parts.method
        self.codec = parts.codec
        self.tp = parts.tp
        self._tp_link = parts.tp_link
        self._close = parts.close  # stops the other ranks (also at exit)
        self.model = parts.model
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.cache = parts.cache
        self.backend = parts.backend
        self.methods = parts.methods
        self.chains = parts.chains
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.checks = parts.checks
        self.output_processor = parts.output_processor
        self.windows = parts.windows
        self._requests = self.output_processor.requests  # live requests by id (benchmarks read them)
        self._detokenizers = self.output_processor.detokenizers
        self._ids = itertools.count()
        self.last_step: StepTiming | None = None
        self._structured: StructuredOutputs | None = None  # made by the first request with a grammar
        self.warmup_tokens = 0  # the warm-up prefill's prompt tokens (engine.warmup; 0: none ran)
        if _tp is None and config.resolved_warmup(self.device, self.tp.world_size):
            self.warmup_tokens = warm_up(self)
        log.info("engine ready: %s, %d pages of %d tokens, method %s, decode windows of %d%s",
                 self.model_config.architecture, self.pool.num_pages, config.page_size, self.method.name,
                 config.decode_steps, " (overlapped)" if self.windows.overlap else "")

    # --- requests -------------------------------------------------------------------------------
    @mirrored
    def check_method(self, method: str | None, method_config: dict | None = None) -> str:
        """Take on ``method`` with ``method_config`` now, on every rank, so that requests naming it later
        cannot fail on it; ConfigError if this engine cannot serve it. Returns the method's name."""
        return self.methods.resolve(method, method_config).name

    @mirrored
    def retain_method(self, method: str | None, method_config: dict | None = None) -> str:
        """``check_method``, and hold the configuration's slot (of ``max_methods``) until
        ``release_method`` with the same arguments: a server retains what its chains name. Returns the name."""
        return self.methods.retain(method, method_config).name

    @mirrored
    def release_method(self, method: str | None, method_config: dict | None = None) -> None:
        """Undo one ``retain_method``; the slot is freed once no retain and no request holds it."""
        self.methods.release(method, method_config)

    @mirrored
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chain_id: str | None = None,
        method: str | None = None,
        method_config: dict | None = None,
    ) -> str:
        """Queue a request. With ``chain_id``, ``prompt`` is the chain's whole history plus the new tokens:
        the chain's retained KV is re-attached as far as the prompt extends it, and only the rest is
        prefilled; when the request ends its KV stays with the chain. ``method``/``method_config`` choose
        the sparse method for this request (default: the engine's); a bad choice raises ConfigError."""
        params = self.checks.sampling_params(params)
        token_ids = self.checks.prompt_token_ids(prompt)
        self.checks.forced_token_ids(params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        grammar = None if params.structured is None else self.structured_outputs.matcher(
            params.structured, params.forced_token_ids)
        chosen = self.methods.resolve(method, method_config)
        if params.fit_max_tokens:
            fitted = self.checks.fitted_max_tokens(chosen, len(token_ids), params, chained=chain_id is not None)
            if fitted != params.max_tokens:
                params = dataclasses.replace(params, max_tokens=fitted)
        self.checks.fits_pool(chosen, len(token_ids), params, chained=chain_id is not None)
        if chain_id is not None:
            self.chains.check_bindable(chain_id)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            generator=make_generator(params.seed, self.device),
            method=chosen,
            prefix_namespace=self.methods.prefix_namespace(chosen),
            max_prefix_reuse=chosen.prefix_reuse_limit(len(token_ids)),
            grammar=grammar,
        )
        if chain_id is not None:
            self.chains.bind(req, chain_id)
        self.output_processor.add(req)
        self.scheduler.add(req)
        return request_id

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """The engine's grammars (compiled-grammar cache, matchers, step masks); made on first use."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                 self.model_config.eos_token_ids)
        return self._structured

    @mirrored
    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        return None if req is None else self.output_processor.abort(req)

    @property
    def overlap_decode(self) -> bool:
        """Whether decode windows are launched before the last one is read (``EngineConfig.overlap_decode``)."""
        return self.windows.overlap

    @overlap_decode.setter
    def overlap_decode(self, on: bool) -> None:
        self.windows.overlap = on

    def _window_in_flight(self) -> bool:
        return self.windows.in_flight()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------------
    @mirrored
    def step(self) -> list[RequestOutput]:
        """Run one step (or one window of decode steps) and return what each request took in it. With
        ``overlap_decode`` a window is launched and its tokens returned by the next ``step`` (which first
        launches the window after it, when the same requests can go on decoding): see engine.decode_window."""
        if self.windows.in_flight():
            outputs, self.last_step = self.windows.take_launching_the_next()
            return outputs
        t0 = time.perf_counter()
        self.last_step = None
        self.chains.memory.expire(time.monotonic())
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        k = self.windows.size(plan)
        prefill = prefill_tokens(plan)
        t1 = time.perf_counter()
        batch = self.runner.prepare(plan)
        t2 = time.perf_counter()
        if k:
            outputs, timing = self.windows.run(batch, k, (t1 - t0, t2 - t1), t2)
            if timing is not None:
                self.last_step = timing
            return outputs
        if self._structured is not None:
            self.runner.sampler.step_masks = self._structured.step_masks([r.grammar for r in batch.sample_requests])
        try:
            sampled = self.runner.execute(batch)
        finally:
            self.runner.sampler.step_masks = None
        if sampled is not None and self.tp.world_size > 1:  # unseeded sampling: every rank takes rank 0's
            sampled.token_ids = self.tp.broadcast_ints(sampled.token_ids, self.device)
        t3 = time.perf_counter()
        self.scheduler.update(plan)
        for method, part in batch.by_method():
            method.end_step(part)
        outputs = []
        if sampled is not None:
            for req, token_id, logprob, top in zip(batch.sample_requests, sampled.token_ids, sampled.logprobs,
                                                   sampled.top_logprobs):
                outputs.append(self.output_processor.append_token(req, token_id, logprob, top))
        self.last_step = StepTiming(len(plan.requests), plan.num_tokens, t1 - t0, t2 - t1, t3 - t2,
                                    time.perf_counter() - t3, prefill_tokens=prefill,
                                    replayed=self.runner.last_replayed)
        return outputs

    # --- chains ---------------------------------------------------------------------------------
    @mirrored
    def delete_chain(self, chain_id: str) -> None:
        self.chains.delete(chain_id)

    @mirrored
    def fork_chain(self, chain_id: str, new_chain_id: str) -> None:
        self.chains.fork(chain_id, new_chain_id)

    @mirrored
    def rewind_chain(self, chain_id: str, num_tokens: int) -> None:
        self.chains.rewind(chain_id, num_tokens)

    @mirrored
    def prune_chain(
        self, chain_id: str, intervals: list[tuple[int, int]], scorer: str | None = None, keep_ratio: float = 0.0,
        defer: bool = True, keep_tokens: int | None = None,
    ) -> PruneResult:
        """Prefix-cache pruning of a chain: see ``ChainManager.prune``; ``scorer`` by registered name. A busy
        chain's prune is queued until its turn ends (status ``deferred``; ``defer=False``: ChainBusyError)."""
        scorer = create_scorer(scorer) if scorer else None
        return self.chains.prune(chain_id, intervals, scorer, keep_ratio, defer, keep_tokens)

    def prune_result(self, prune_id: int) -> PruneResult:
        return self.chains.prune_result(prune_id)

    @mirrored
    def pin_chain(self, chain_id: str, pinned: bool = True) -> None:
        self.chains.memory.set_pinned(chain_id, pinned)

    @mirrored
    def chain_hints(self, chain_id: str, *, priority: int | None = None, ttl_s: float | None = None,
                    clear_ttl: bool = False) -> None:
        """Session hints: retention ``priority`` and ``ttl_s`` (``ChainManager.set_hints``)."""
        self.chains.memory.set_hints(chain_id, priority=priority, ttl_s=ttl_s, clear_ttl=clear_ttl)

    @mirrored
    def release_chain(self, chain_id: str) -> bool:
        """Take an idle chain's KV off the device now (to the host tier, else dropped)."""
        return self.chains.memory.release(chain_id)

    @mirrored
    def prefetch_chain(self, chain_id: str) -> bool:
        """Load an idle chain's offloaded KV back to the device now."""
        return self.chains.memory.prefetch(chain_id)

    def chain_info(self, chain_id: str) -> ChainInfo:
        state = self.chains.index.get(chain_id)
        busy = self._requests.get(state.busy_request) if state.busy_request else None
        return self.chains.info(chain_id, busy)

    @mirrored
    def adopt_chain(self, path: str) -> bool:
        """Take over a chain another engine wrote to its disk tier (a drained replica's handoff file): the file
        moves into this engine's disk tier, replacing its own older copy of the chain, and the next turn loads it.
        False when there is nothing to adopt (no disk tier here, the file gone or unreadable, its method not
        served here)."""
        return self.chains.adopt(Path(path), self.methods.resolve)

    @mirrored
    def persist_chains(self) -> int:
        """Write every idle chain's KV to the disk tier (``chain_disk_dir``), for the next process started on the
        same directory; returns how many (0 without a disk tier). A server calls it when it shuts down."""
        return self.chains.memory.persist()

    # --- cache ----------------------------------------------------------------------------------
    @mirrored
    def clear_prefix_cache(self) -> None:
        self.cache.clear_prefix_cache()

    # --- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at tensor_parallel_size 1). Idempotent."""
        self._close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
