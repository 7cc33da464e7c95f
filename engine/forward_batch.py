"""ForwardBatch: the tensors of one step, built once from a StepPlan and shared by every layer and hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.contract.cache import CacheManager
from engine.contract.view import PagedView
from engine.request import Request
from engine.scheduler import StepPlan


@dataclass(slots=True)
class ForwardBatch:
    """``requests[i]`` contributes ``num_new_tokens[i]`` tokens, rows ``view.query_start_loc[i]:[i+1]``.

    input_ids, positions (logical, for RoPE): [T] int64. slot_mapping (physical, for KV writes): [T] int64,
    or [num_layers, T] when layers differ in physical length.
    logits_indices: [N] rows whose logits are sampled, one per request in ``sample_requests``.
    finished_prompt: requests whose prompt's last token is computed in this step.
    scratch: per-step space for a method's own data (e.g. an observation layer's selection).
    probe: runs extra query tokens against a request's KV without committing them (engine/probe.py).
    """

    requests: list[Request]
    num_new_tokens: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    view: PagedView
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    finished_prompt: list[Request]
    cache: CacheManager
    layer_views: list[PagedView] | None = None
    scratch: dict[str, Any] = field(default_factory=dict)
    probe: Any = None  # engine.probe.Prober: a method may probe a request's KV from a hook (between steps' forwards)

    def view_for(self, layer: int) -> PagedView:
        return self.view if self.layer_views is None else self.layer_views[layer]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(plan: StepPlan, cache: CacheManager, device: torch.device) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    sample_requests: list[Request] = []
    finished_prompt: list[Request] = []
    for req, n in zip(plan.requests, plan.num_new_tokens):
        start = req.num_computed_tokens
        end = start + n
        if n == 1:
            input_ids.append(req.token_ids[start])
            positions.append(start)
        else:
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
        if end == req.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sample_requests.append(req)
        if start < req.num_prompt_tokens <= end:
            finished_prompt.append(req)
    slot_mapping = cache.slot_mapping(plan.requests, plan.num_new_tokens)  # first: it may plan the step's writes
    # layer 0's view is the step's view (build_view's default layer): built once, not again for ``view``
    layer_views = cache.build_layer_views(plan.requests, plan.num_new_tokens)
    return ForwardBatch(
        requests=plan.requests,
        num_new_tokens=plan.num_new_tokens,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=slot_mapping,
        view=layer_views[0] if layer_views is not None else cache.build_view(plan.requests, plan.num_new_tokens),
        layer_views=layer_views,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sample_requests=sample_requests,
        finished_prompt=finished_prompt,
        cache=cache,
    )
