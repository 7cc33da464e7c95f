"""ModelRunner: executes one StepPlan through the model, the method's hooks and the attention backend.

The runner is the model's ``LayerRunner``: every attention call goes
before_attention -> cache.write -> method.select -> backend -> after_attention, so the dense path and every
sparse method take the same way through.
"""

from __future__ import annotations

import torch

from engine.attention_backend import TorchReferenceBackend
from engine.contract.cache import CacheManager
from engine.contract.method import SparseMethod
from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch, build_forward_batch
from engine.sampler import SampleOutput, Sampler
from engine.scheduler import StepPlan


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
        self.wants_layer_output = type(method).end_layer is not SparseMethod.end_layer
        self._batch: ForwardBatch | None = None
        self.prober = None  # engine.probe.Prober, handed to methods as ForwardBatch.probe

    def capture_decode_graphs(self, max_batch: int, max_pages: int, show_progress: bool = True) -> None:
        self.graphs = DecodeGraphs(self, max_batch, max_pages, self.cache.scratch_page, self.cache.spec.page_size)
        self.graphs.capture(show_progress)

    def _can_replay(self, batch: ForwardBatch) -> bool:
        g = self.graphs
        return (g is not None and batch.view.is_pure_decode and g.can_read(batch)
                and not batch.finished_prompt
                and batch.num_tokens <= g.max_batch and batch.view.block_tables.shape[1] <= g.block_tables.shape[1]
                and self.method.replayable(batch))

    # --- LayerRunner ----------------------------------------------------------------------------
    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        method = self.method
        method.before_attention(layer_idx, batch)
        self.cache.write(layer_idx, k, v, batch.slot_mapping)
        view = method.select(layer_idx, q, batch)
        k_cache, v_cache = self.cache.layer_kv(layer_idx)
        if method.needs.received_attention:
            out, scores = self.backend.forward_received(q, k_cache, v_cache, view, self.scale,
                                                        self.cache.spec.num_kv_heads)
        else:
            out, scores = self.backend.forward(
                q, k_cache, v_cache, view, self.scale, return_scores=method.needs.attention_scores
            )
        method.after_attention(layer_idx, batch, out, scores)
        return out

    def end_layer(self, layer_idx: int, hidden: torch.Tensor) -> None:
        self.method.end_layer(layer_idx, self._batch, hidden)

    # --- one step -------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        batch = build_forward_batch(plan, self.cache, self.device)
        batch.probe = self.prober
        return batch

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> SampleOutput | None:
        self._batch = batch
        try:
            self.method.begin_step(batch)
            if self._can_replay(batch):
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
