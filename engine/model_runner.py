"""ModelRunner: executes one StepPlan through the model, the method's hooks and the attention backend.

The runner is the model's ``LayerRunner``: every attention call goes
before_attention -> cache.write -> method.select -> backend -> after_attention, so the dense path and every
sparse method take the same way through. A step whose requests use several methods runs each method's
select / backend / after_attention over its own requests' query rows (``ForwardBatch.groups``); the model's
other layers run once over all of them.
"""

from __future__ import annotations

import torch

from agentrt_kernels import ops
from engine.attention_backend import TorchReferenceBackend
from engine.contract.cache import CacheManager
from engine.contract.method import SparseMethod
from engine.contract.view import PagedView
from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch, build_forward_batch, next_decode_step
from engine.latent_expansion import LatentExpansion, attend_split, requests_to_expand
from engine.parallel.state import reduce_over_query_heads
from engine.sampler import SampleOutput, Sampler
from engine.scheduler import StepPlan


def replays_captured_graph(captured: SparseMethod, method: SparseMethod, part: ForwardBatch) -> bool:
    """Whether ``method``'s rows ``part`` of a pure-decode step (no prompt completing in it) may replay graphs
    captured with ``captured`` (the engine's method): every request's ``decode_capabilities`` allows it, and
    when either method's hooks are part of the captured work (``graph_hooks``) the two are the same instance."""
    if (method.decode.graph_hooks or captured.decode.graph_hooks) and method is not captured:
        return False
    return all(method.decode_capabilities(req).replay for req in part.requests)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: CacheManager,
        method: SparseMethod,
        backend: TorchReferenceBackend,
        scale: float,
        device: torch.device,
    ):
        self.model = model
        self.cache = cache
        self.method = method
        self.backend = backend
        self.scale = scale
        self.device = device
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self._batch: ForwardBatch | None = None
        self.prober = None  # engine.probe.Prober, handed to methods as ForwardBatch.probe
        self.last_replayed = False  # the last execute replayed decode graphs (every step of a window)
        self.mla_prefill = "absorbed"  # EngineConfig.mla_prefill: how latent layers run prompt chunks

    def capture_decode_graphs(self, max_batch: int, max_pages: int, show_progress: bool = True) -> None:
        self.graphs = DecodeGraphs(self, max_batch, max_pages, self.cache.scratch_page, self.cache.spec.page_size)
        self.graphs.capture(show_progress)

    def _can_replay(self, batch: ForwardBatch) -> bool:
        g = self.graphs
        return (g is not None and batch.view.is_pure_decode and g.can_read(batch)
                and not batch.finished_prompt
                and batch.num_tokens <= g.max_batch and batch.view.block_tables.shape[1] <= g.block_tables.shape[1]
                and all(replays_captured_graph(self.method, m, b) for m, b in batch.by_method()))

    # --- LayerRunner ----------------------------------------------------------------------------
    @property
    def wants_layer_output(self) -> bool:
        methods = [self.method] if self._batch is None else [m for m, _ in self._batch.by_method()]
        return any(m.decode.layer_output for m in methods)

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        for method, part in batch.by_method():
            method.before_attention(layer_idx, part)
        self.cache.write(layer_idx, k, v, batch.slot_mapping, batch.positions)
        return self._attend_groups(layer_idx, q)

    def attention_rotary(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, rotary, qk_norm: tuple | None = None) -> torch.Tensor:
        """``attention`` for q/k before RoPE (and before their per-head ``qk_norm`` = (q_norm, k_norm), if any):
        the cache normalizes, rotates and stores in one go (``write_rotated``)."""
        batch = self._batch
        for method, part in batch.by_method():
            method.before_attention(layer_idx, part)
        q = self.cache.write_rotated(layer_idx, q, k, v, batch.slot_mapping, positions, rotary, qk_norm=qk_norm)
        return self._attend_groups(layer_idx, q)

    def _attend_groups(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        if batch.groups is None:
            return self._attend(batch.method, layer_idx, q, batch)
        return torch.cat([self._attend(g.method, layer_idx, q[g.start:g.stop], g.batch) for g in batch.groups])

    def latent_inputs(self, layer_idx: int, q_latent: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                      positions: torch.Tensor, rotary, norm, scale: float, interleave: bool,
                      value_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A latent (MLA) layer's attention inputs (``ops.latent_inputs``: query, row, rotated q_pe) with its new
        rows stored: by the same launch where the storage hands out its rows (``CacheManager.row_target``), else
        through ``write`` (values the rows' first ``value_dim`` channels). ``latent_attention`` follows."""
        batch = self._batch
        for method, part in batch.by_method():
            method.before_attention(layer_idx, part)
        args = (q_latent, q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache, norm.weight, norm.eps, scale,
                interleave)
        target = self.cache.row_target(layer_idx)
        if target is not None:
            slots = batch.slot_mapping if batch.slot_mapping.dim() == 1 else batch.slot_mapping[layer_idx]
            return ops.latent_inputs(*args, cache_rows=target, slots=slots)
        query, row, q_pe = ops.latent_inputs(*args)
        self.cache.write(layer_idx, row, row[..., :value_dim], batch.slot_mapping, batch.positions)
        return query, row, q_pe

    def latent_attention(self, layer_idx: int, q: torch.Tensor, row: torch.Tensor, value_dim: int,
                         expansion: LatentExpansion) -> torch.Tensor:
        """``attention`` for a latent (MLA) layer -> [T, H, v], after ``latent_inputs`` stored the step's rows:
        ``q`` the absorbed queries, ``row`` [T, 1, width] the new latent rows (keys; values their first
        ``value_dim`` channels). Prompt chunks of a plain view may take the expanded form
        (``engine.latent_expansion``, by ``mla_prefill``); every method hook runs as for ``attention``, with the
        absorbed queries; ``after_attention`` then sees outputs of v channels."""
        batch = self._batch
        if batch.groups is not None:
            return expansion.absorb(self._attend_groups(layer_idx, q))
        method = batch.method
        view = method.select(layer_idx, q, batch)
        k_cache, v_cache = self.cache.layer_kv(layer_idx)
        plain = (type(view) is PagedView and isinstance(k_cache, torch.Tensor)
                 and not (method.needs.attention_scores or method.needs.received_attention))
        expand = requests_to_expand(self.mla_prefill if plain else "absorbed", expansion, view.query_lens_cpu,
                                    q.is_cuda)
        if not any(expand):
            return expansion.absorb(self._run_backend(method, layer_idx, q, batch, view, k_cache, v_cache))
        out = attend_split(q, view, k_cache, expand, expansion,
                           lambda rows, sub: self.backend.forward(rows, k_cache, v_cache, sub, self.scale)[0])
        method.after_attention(layer_idx, batch, out, None)
        return out

    def _attend(self, method: SparseMethod, layer_idx: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        view = method.select(layer_idx, q, batch)
        k_cache, v_cache = self.cache.layer_kv(layer_idx)
        return self._run_backend(method, layer_idx, q, batch, view, k_cache, v_cache)

    def _run_backend(self, method: SparseMethod, layer_idx: int, q: torch.Tensor, batch: ForwardBatch,
                     view: PagedView, k_cache, v_cache) -> torch.Tensor:
        if method.needs.received_attention:
            out, scores = self.backend.forward_received(q, k_cache, v_cache, view, self.scale,
                                                        self.cache.spec.num_kv_heads)
            scores = [reduce_over_query_heads(s, "sum") for s in scores]
        else:
            out, scores = self.backend.forward(
                q, k_cache, v_cache, view, self.scale, return_scores=method.needs.attention_scores
            )
        method.after_attention(layer_idx, batch, out, scores)
        return out

    def linear_state(self, layer_idx: int):
        """The step's requests' recurrent state of linear-attention layer ``layer_idx`` (hybrid models)."""
        batch = self._batch
        if batch.state_slots is not None:
            return self.cache.storage.linear_state_at(batch.state_slots, layer_idx, batch.view.query_lens_cpu)
        return self.cache.linear_state(batch.requests, layer_idx, batch.view.query_lens_cpu)

    def end_layer(self, layer_idx: int, hidden: torch.Tensor) -> None:
        batch = self._batch
        if batch.groups is None:
            batch.method.end_layer(layer_idx, batch, hidden)
            return
        for g in batch.groups:
            g.method.end_layer(layer_idx, g.batch, hidden[g.start:g.stop])

    # --- one step -------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        batch = build_forward_batch(plan, self.cache, self.device)
        batch.probe = self.prober
        return batch

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> SampleOutput | None:
        self._batch = batch
        try:
            for method, part in batch.by_method():
                method.begin_step(part)
            self.last_replayed = self._can_replay(batch)
            if self.last_replayed:
                logits = self.graphs.run(batch)
            else:
                hidden = self.model(batch.input_ids, batch.positions, self)
                if not batch.sample_requests:
                    return None
                logits = self.model.compute_logits(hidden[batch.logits_indices])
            reqs = batch.sample_requests
            return self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs],
                                       [r.forced_next_token() for r in reqs])
        finally:
            self._batch = None

    @torch.inference_mode()
    def execute_decode_steps(
        self, batch: ForwardBatch, k: int, ahead: int = 0
    ) -> tuple[list[tuple], ForwardBatch]:
        """``k`` decode steps of a pure-decode batch whose method allows a window of them
        (``DecodeCapabilities.window``), back to back on the device: step ``j + 1`` reads the tokens step ``j``
        sampled (``next_decode_step``), so the host never waits between them. ``ahead``: decode steps of these
        requests already launched whose tokens the host has not taken (``batch`` was then built on the device by
        ``next_decode_step``). Returns each step's ``Sampler.sample_tensors`` result (tokens, logprobs, top
        logprobs), still on the device, and the last step's batch."""
        assert batch.groups is None and batch.view.is_pure_decode
        reqs = batch.sample_requests
        params, generators = [r.params for r in reqs], [r.generator for r in reqs]
        steps, self.last_replayed = [], True
        for j in range(k):
            if j:
                batch = next_decode_step(batch, steps[-1][0])
            self._batch = batch
            try:
                if self._can_replay(batch):
                    logits = self.graphs.run(batch)
                else:
                    self.last_replayed = False
                    if j or ahead:
                        self.cache.plan_decode_writes(batch)
                    hidden = self.model(batch.input_ids, batch.positions, self)
                    logits = self.model.compute_logits(hidden[batch.logits_indices])
                forced = [r.forced_next_token(ahead + j) for r in reqs]
                steps.append(self.sampler.sample_tensors(logits, params, generators, forced))
            finally:
                self._batch = None
        return steps, batch
