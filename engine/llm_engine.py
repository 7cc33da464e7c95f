"""LLMEngine: the step-level API the server drives (add a request, run one step, collect outputs, abort).

One step is ``schedule -> prepare -> execute -> update -> end_step -> append samples``; see
docs/architecture.md for who owns what.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention_backend import make_backend
from engine.chain_index import ChainInfo
from engine.chain_manager import ChainManager, PruneResult
from engine.config import DEFAULT_CPU_KV_BYTES, DTYPES, EngineConfig
from engine.contract.cache import CacheSpec
from engine.contract.codec import CodedCacheSpec, check_composes
from engine.contract.method import UNBOUNDED_WINDOW, SparseMethod
from engine.decode_window import DecodeWindow, launch_copies
from engine.detokenizer import IncrementalDetokenizer, decoder_for
from engine.errors import CheckpointError, ConfigError, InvalidRequestError, InvalidSamplingParamsError, OutOfPagesError
from engine.forward_batch import next_decode_step
from engine.loader import load_model
from engine.method_set import MethodSet
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.page_pool import PagePool
from engine.parallel.workers import mirrored
from engine.parallel.workers import start as start_tensor_parallel
from engine.probe import Prober
from engine.registry import create_kv_storage, create_method, create_scorer
from engine.request import FinishReason, Request
from engine.sampler import TopLogprobs, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, StepPlan
from engine.structured_output import StructuredOutputs, advance

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepTiming:
    """Wall time of the last step's phases, in seconds (execute includes the device work it waits on)."""

    num_requests: int
    num_tokens: int
    schedule_s: float
    prepare_s: float
    execute_s: float
    update_s: float
    decode_steps: int = 1  # decode steps this step() ran back to back (EngineConfig.decode_steps)
    prefill_tokens: int = 0  # of num_tokens, those of prompts (the rest decode)
    replayed: bool = False  # the forward replayed decode CUDA graphs
    overlapped: bool = False  # the next window was launched before this one's tokens were read (overlap_decode)

    @property
    def kind(self) -> str:
        """decode-graph | decode-eager | mixed (prompt chunks and decodes) | prefill."""
        if self.prefill_tokens == 0:
            return "decode-graph" if self.replayed else "decode-eager"
        return "prefill" if self.prefill_tokens == self.num_tokens else "mixed"


def _prefill_tokens(plan) -> int:
    """Prompt tokens among the plan's scheduled tokens (before ``Scheduler.update`` advances the counts)."""
    return sum(max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
               for req, n in zip(plan.requests, plan.num_new_tokens))


def _steps_left(req: Request, launched: int) -> int:
    """Decode steps ``req`` may still take after the ``launched`` ones whose tokens the host has not read: its
    ``max_tokens`` and ``max_model_len`` both bound them."""
    return min(req.params.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens) - launched


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad tokenizer dir
        raise CheckpointError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc


class LLMEngine:
    def __init__(self, config: EngineConfig, _tp=None):
        """``_tp``: (group, link) when built as a tensor-parallel rank > 0 (engine.parallel.workers)."""
        self.config = config
        self.device = config.resolved_device()
        self.method = create_method(config.method, config.method_config)  # bad knobs fail before the load
        self.codec = None
        if config.kv_storage is not None:
            self.codec = create_kv_storage(config.kv_storage, config.kv_storage_config)
            check_composes(self.codec, self.method.name, self.method.view_types)
        self.tp, self._tp_link, self.device = start_tensor_parallel(config, self.device, _tp)
        self._close = weakref.finalize(self, self._tp_link.close)  # stops the other ranks (also at exit)
        dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
        self.model, self.model_config = load_model(
            config.model, dtype=dtype, device=self.device, load_format=config.load_format, tp=self.tp
        )
        if config.resolved_fused_decode_linears(self.device, self.tp.world_size):
            self._fuse_decode_linears(asked=config.fused_decode_linears is True)
        self.tokenizer = load_tokenizer(config.model)
        self._decode = decoder_for(self.tokenizer)  # what every request's detokenizer decodes with
        if self.codec is not None:
            self.codec.bind_model(self.model)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        spec = CacheSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads // self.tp.world_size,  # this rank's KV heads
            head_dim=mc.head_dim,
            dtype=next(self.model.parameters()).dtype,
            device=self.device,
            page_size=config.page_size,
        )
        if self.codec is not None:
            self.codec.check(spec)
            windows = config.max_num_seqs if self.codec.has_window else 0
            spec = CodedCacheSpec(**{f: getattr(spec, f) for f in CacheSpec.__dataclass_fields__},
                                  codec=self.codec, max_windows=windows)
        self.pool = PagePool(self._num_pages(spec))
        self.method.validate(spec)
        self.cache = self.method.make_cache(spec, self.pool, config.enable_prefix_caching)
        if self.codec is not None and getattr(self.cache, "codec", None) is not self.codec:
            raise ConfigError(f"method {self.method.name!r} builds a cache that does not store through "
                              f"kv_storage {self.codec.name!r}")
        self.method.bind(self.cache)
        self.backend = make_backend(config.attention_backend, self.device, self.method, spec.dtype, self.codec,
                                    spec.head_dim)
        self.methods = MethodSet(self.method, lambda m: self._take_on(m, spec), config.max_methods)
        self.chains = ChainManager(self.cache, mc.num_layers)
        self.scheduler = Scheduler(self.cache, config.max_num_batched_tokens, config.max_num_seqs,
                                   on_preempt=self._on_preempt, reclaim=self.chains.reclaim)
        self.runner = ModelRunner(self.model, self.cache, self.method, self.backend, mc.head_dim**-0.5, self.device)
        self.runner.prober = self.chains.prober = Prober(
            self.model, self.cache, mc.head_dim**-0.5, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            self.backend)
        self._maybe_capture_graphs()
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.last_step: StepTiming | None = None
        self._window: DecodeWindow | None = None  # overlap_decode: the window launched, its tokens not taken
        self._overlap_decode = config.resolved_overlap_decode(self.device, self.tp.world_size)
        self._structured: StructuredOutputs | None = None  # made by the first request with a grammar
        self._tp_link.wait_ready()
        log.info("engine ready: %s, %d pages of %d tokens, method %s, decode windows of %d%s", mc.architecture,
                 self.pool.num_pages, config.page_size, self.method.name, config.decode_steps,
                 " (overlapped)" if self._overlap_decode else "")

    def _fuse_decode_linears(self, asked: bool) -> None:
        decoder = getattr(self.model, "model", None)
        if not hasattr(decoder, "fused_decode_rows"):
            if not asked:  # the default: the architectures that have the fused path
                return
            raise ConfigError(f"fused_decode_linears: {self.model_config.architecture} has no fused decode path")
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("fused_decode_linears runs Triton kernels: a GPU, or TRITON_INTERPRET=1 on the CPU")
        from agentrt_kernels.triton.decode_linear import MAX_ROWS

        decoder.fused_decode_rows = MAX_ROWS

    def _maybe_capture_graphs(self) -> None:
        reasons = []
        if self.device.type != "cuda":
            reasons.append("not on a GPU")
        if self.config.enforce_eager:
            reasons.append("enforce_eager")
        if not self.backend.cuda_graph_safe:
            reasons.append(f"backend {self.backend.name} is not graph-safe")
        if not self.method.cuda_graph_safe and type(self.method).replayable is SparseMethod.replayable:
            reasons.append(f"method {self.method.name} does host work per layer")
        if self.tp.world_size > 1:
            reasons.append("tensor parallel (collectives are not captured)")
        if not getattr(self.model, "cuda_graph_safe", True):
            reasons.append(f"{self.model_config.architecture} forward syncs with the host")
        if reasons:
            log.info("decode CUDA graphs off: %s", "; ".join(reasons))
            return
        max_batch = self.config.cuda_graph_max_batch or self.config.max_num_seqs
        max_pages = -(-self.max_model_len // self.config.page_size)
        self.runner.capture_decode_graphs(max_batch, max_pages)

    def _num_pages(self, spec: CacheSpec) -> int:
        if self.config.num_pages is not None:
            return self.config.num_pages
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
        budget = budget if budget is not None else DEFAULT_CPU_KV_BYTES
        windows = getattr(spec, "window_bytes", 0)  # a codec's full-precision windows share the budget
        budget -= windows
        num_pages = budget // spec.bytes_per_page
        if num_pages < 1:
            held = f" after {windows} bytes of kv_storage windows (max_num_seqs of them)" if windows else ""
            raise OutOfPagesError(
                f"KV budget of {budget} bytes{held} holds no page of {spec.bytes_per_page} bytes; on a GPU the "
                "budget is gpu_memory_utilization x total memory minus what is already in use (other engines "
                "included): lower it or set kv_cache_memory_bytes / num_pages"
            )
        return self._tp_link.agree_min(num_pages)  # every rank's pool the same size: the same schedule

    def _take_on(self, method: SparseMethod, spec: CacheSpec) -> None:
        """Check that a method a request names can run here, then hand it the cache (engine.method_set)."""
        if self.codec is not None:
            check_composes(self.codec, method.name, method.view_types)
        reasons = self.backend.unsupported(method, spec.dtype, self.codec, spec.head_dim)
        if reasons:
            raise ConfigError(f"method {method.name!r} cannot run on attention backend {self.backend.name!r}: "
                              + "; ".join(reasons))
        method.validate(spec)
        method.bind(self.cache)

    def _on_preempt(self, req: Request) -> None:
        req.method.release(req)
        self.chains.on_preempt(req)

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
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.forced_token_ids):
            raise InvalidSamplingParamsError(f"forced_token_ids must be < the vocabulary size {vocab}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        grammar = None if params.structured is None else self.structured_outputs.matcher(
            params.structured, params.forced_token_ids)
        chosen = self.methods.resolve(method, method_config)
        max_new = min(params.max_tokens, self.max_model_len - len(token_ids))
        held = min(len(token_ids) + max_new, chosen.max_physical_tokens(
            len(token_ids), max_new, self.config.max_num_batched_tokens))
        pages = -(-held // self.config.page_size) + (chain_id is not None)  # a forked chain's tail page copy
        if pages > self.pool.num_pages:
            raise InvalidRequestError(
                f"request needs up to {pages} KV pages ({held} tokens held at once) but the pool has "
                f"{self.pool.num_pages}"
            )
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
        self._requests[request_id] = req
        self.methods.hold(chosen)  # dropped in _forget: a retained configuration outlives its running requests
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, len(token_ids), decode=self._decode)
        self.scheduler.add(req)
        return request_id

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """The engine's grammars (compiled-grammar cache, matchers, step masks); made on first use."""
        if self._structured is None:
            self._structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                 self.model_config.eos_token_ids)
        return self._structured

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token id {bad!r} is not an int in [0, {vocab})")
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        return token_ids

    @mirrored
    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        out = self._output(req, [], "")
        self._forget(req)
        return out

    @property
    def overlap_decode(self) -> bool:
        """Whether decode windows are launched before the last one is read (``EngineConfig.overlap_decode``)."""
        return self._overlap_decode

    @overlap_decode.setter
    def overlap_decode(self, on: bool) -> None:
        if self._window_in_flight():
            raise ConfigError("overlap_decode cannot change while a decode window is in flight")
        if on and self.tp.world_size > 1:
            raise ConfigError("overlap_decode needs tensor_parallel_size 1")
        self._overlap_decode = bool(on)

    def _window_in_flight(self) -> bool:
        if self._window is not None and all(r.is_finished for r in self._window.requests):
            self._window = None  # every request it ran for was aborted since: nothing to take from it
        return self._window is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------------
    @mirrored
    def step(self) -> list[RequestOutput]:
        """Run one step (or one window of decode steps) and return what each request took in it. With
        ``overlap_decode`` a window is launched and its tokens returned by the next ``step`` (which first
        launches the window after it, when the same requests can go on decoding): see engine.decode_window."""
        if self._window_in_flight():
            return self._take_window_launching_the_next()
        t0 = time.perf_counter()
        self.last_step = None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        k = self._decode_window(plan)
        prefill_tokens = _prefill_tokens(plan)
        t1 = time.perf_counter()
        batch = self.runner.prepare(plan)
        t2 = time.perf_counter()
        if k:
            window = self._launch_window(batch, k)
            if self._overlap_decode:
                self._window = window
                return []  # its tokens come with the next step
            return self._take_window(window, (t1 - t0, t2 - t1), time.perf_counter() - t2)
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
                outputs.append(self._append_token(req, token_id, logprob, top))
        self.last_step = StepTiming(len(plan.requests), plan.num_tokens, t1 - t0, t2 - t1, t3 - t2,
                                    time.perf_counter() - t3, prefill_tokens=prefill_tokens,
                                    replayed=self.runner.last_replayed)
        return outputs

    def _decode_window(self, plan) -> int:
        """How many decode steps this plan runs as a window on the device (0: a plain step): at most
        ``config.decode_steps``, when every request decodes one token with the same method, whose hooks would do
        nothing on those steps (``SparseMethod.max_decode_window`` >= 2), on several ranks only greedy or seeded
        ones, and each has the length and the pages left for them (pages for the extra steps are allocated
        here); two steps at least, or one with ``overlap_decode`` (the next launched before it is read). Never
        for a request with a grammar: its next mask depends on the matcher state, which the host only learns by
        reading the token just sampled."""
        k = self.config.decode_steps
        if (k == 1 and not self._overlap_decode) or plan.preempted:
            return 0
        if any(req.grammar is not None for req in plan.requests):
            return 0
        if any(req.method is not plan.requests[0].method for req in plan.requests):
            return 0  # requests of several methods: each method's hooks see its own sub-batch, step by step
        for req, n in zip(plan.requests, plan.num_new_tokens):
            if n != 1 or req.num_computed_tokens < req.num_prompt_tokens:
                return 0
            if self.tp.world_size > 1 and not (req.params.is_greedy or req.params.seed is not None):
                return 0  # every rank must sample the same tokens on its own: unseeded draws differ
            window = req.method.max_decode_window(req)
            if window < 2:
                return 0  # its hooks act on the next step
            k = min(k, _steps_left(req, 0), window)
        if k < (1 if self._overlap_decode else 2) or not all(self.cache.allocate(req, k) for req in plan.requests):
            return 0  # pages some requests took ahead stay theirs: later steps use them
        return k

    def _launch_window(self, batch, k: int, ahead: int = 0) -> DecodeWindow:
        steps, last = self.runner.execute_decode_steps(batch, k, ahead)
        tokens, logprobs, top, ready = launch_copies(steps)
        return DecodeWindow(list(batch.sample_requests), k, tokens, logprobs, top, ready, last, steps[-1][0],
                            self.runner.last_replayed)

    def _next_window_size(self, window: DecodeWindow) -> int:
        """Decode steps the window after ``window`` may run before the host has read ``window`` (0: none):
        its requests are the running ones and nothing waits to be admitted, each method's window is unbounded
        (nothing the host learns from ``window`` changes it), each request has the length left, and pages are
        allocated here."""
        reqs = window.requests
        running = {id(r) for r in self.scheduler.running}
        if self.scheduler.waiting or len(running) != len(reqs) or not all(id(r) in running for r in reqs):
            return 0
        done = window.k
        k = self.config.decode_steps
        for req in reqs:
            if req.method.max_decode_window(req) < UNBOUNDED_WINDOW:
                return 0
            k = min(k, _steps_left(req, done))
        if k < 1 or not all(self.cache.allocate(req, done + k) for req in reqs):
            return 0
        return k

    def _take_window_launching_the_next(self) -> list[RequestOutput]:
        window, self._window = self._window, None
        t0 = time.perf_counter()
        k = self._next_window_size(window)
        t1 = t2 = time.perf_counter()
        if k:
            batch = next_decode_step(window.last_batch, window.last_tokens, self.cache.block_tables(window.requests))
            t2 = time.perf_counter()
            self._window = self._launch_window(batch, k, ahead=window.k)
        try:
            return self._take_window(window, (t1 - t0, t2 - t1), time.perf_counter() - t2, overlapped=bool(k))
        except BaseException:
            self._window = None  # it follows tokens the host did not take: the requests go on from the host's
            raise

    def _take_window(self, window: DecodeWindow, host_s: tuple[float, float], launch_s: float,
                     overlapped: bool = False) -> list[RequestOutput]:
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
        text_before = {reqs[i].request_id: len(self._detokenizers[reqs[i].request_id].text) for i in live}
        stops: dict[str, str | int | None] = {}
        taking = [reqs[i] for i in live]
        for j in range(window.k):
            if not live:
                break
            self.scheduler.update(StepPlan([reqs[i] for i in live], [1] * len(live)))
            for i in live:
                req = reqs[i]
                lp = logprobs[j][i] if req.params.logprobs else None
                stops[req.request_id] = self._accept_token(req, tokens[j][i], lp, tops[j][i])
                taken[req.request_id].append(tokens[j][i])
            live = [i for i in live if not reqs[i].is_finished]
        outputs = [self._emit(req, taken[req.request_id], text_before[req.request_id], stops.get(req.request_id))
                   for req in taking]
        self.last_step = StepTiming(len(reqs), len(reqs), host_s[0], host_s[1], launch_s + t3 - t_wait,
                                    time.perf_counter() - t3, decode_steps=window.k, replayed=window.replayed,
                                    overlapped=overlapped)
        return outputs

    def _append_token(self, req: Request, token_id: int, logprob: float | None,
                      top: TopLogprobs | None) -> RequestOutput:
        before = len(self._detokenizers[req.request_id].text)
        return self._emit(req, [token_id], before, self._accept_token(req, token_id, logprob, top))

    def _accept_token(self, req: Request, token_id: int, logprob: float | None,
                      top: TopLogprobs | None) -> str | int | None:
        """Append one sampled token; finish the request if it stops (its grammar ending included) or reaches its
        length (its stop reason)."""
        req.append_output(token_id, logprob, top)
        grammar_ended = req.grammar is not None and advance(req.grammar, token_id)
        detok = self._detokenizers[req.request_id]
        delta = detok.update(req.token_ids)
        stop_reason: str | int | None = None
        if req.stop_by_token(token_id):
            stop_reason = token_id
        elif (stop := detok.truncate_at_stop(req.params.stop, len(delta), req.params.include_stop_str_in_output)):
            stop_reason = stop
        if stop_reason is not None or grammar_ended:
            self._finish(req, FinishReason.STOP)
        elif req.reached_length_limit():
            self._finish(req, FinishReason.LENGTH)
        return stop_reason

    def _emit(self, req: Request, new_ids: list[int], text_before: int, stop_reason) -> RequestOutput:
        out = self._output(req, new_ids, self._detokenizers[req.request_id].text[text_before:], stop_reason)
        if req.is_finished:
            self._forget(req)
        return out

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.chain_id is not None:
            self.chains.retain(req, reason)
        self.scheduler.finish(req, reason)
        req.method.release(req)

    def _forget(self, req: Request) -> None:
        del self._requests[req.request_id]
        self.methods.drop(req.method)
        del self._detokenizers[req.request_id]

    def _output(self, req: Request, new_ids: list[int], new_text: str, stop_reason=None) -> RequestOutput:
        text = self._detokenizers[req.request_id].text
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=list(req.output_logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.top_logprobs else None,
            stop_reason=stop_reason,
            chain_id=req.chain_id,
            resume_status=req.resume_status,
            num_prefilled_tokens=req.num_prefilled_tokens,
            num_resumed_tokens=req.num_resumed_tokens,
        )

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
        self.chains.set_pinned(chain_id, pinned)

    def chain_info(self, chain_id: str) -> ChainInfo:
        state = self.chains.index.get(chain_id)
        busy = self._requests.get(state.busy_request) if state.busy_request else None
        return self.chains.info(chain_id, busy)

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
