"""ForwardBatch: the tensors of one step, built once from a StepPlan and shared by every layer and hook."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.contract.cache import CacheManager
from engine.contract.view import PagedView, QuantizedPagesView
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
    method: the SparseMethod of every request here, or None when requests of several methods share the step;
    then ``groups`` holds one sub-batch per method (requests ordered by group, so each group's query rows
    are one contiguous range) and each method's hooks see only its own sub-batch.
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
    method: Any = None
    groups: list[MethodGroup] | None = None
    # a hybrid model's recurrent-state slots per row, as a device tensor: set by a decode graph's static batch
    # (None: the runner takes them from the requests' tables)
    state_slots: torch.Tensor | None = None

    def view_for(self, layer: int) -> PagedView:
        return self.view if self.layer_views is None else self.layer_views[layer]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def by_method(self) -> list[tuple[Any, ForwardBatch]]:
        """(method, the part of this step it owns) for each method in the step."""
        if self.groups is None:
            return [(self.method, self)]
        return [(g.method, g.batch) for g in self.groups]


@dataclass(slots=True)
class MethodGroup:
    """The requests of one method in a step shared by several: query rows ``start:stop`` of the step."""

    method: Any
    batch: ForwardBatch
    start: int
    stop: int


def order_by_method(plan: StepPlan) -> list[Any]:
    """Reorder ``plan`` so that each method's requests are adjacent (first-seen order); returns the methods."""
    methods: list[Any] = []
    for req in plan.requests:
        if all(req.method is not m for m in methods):
            methods.append(req.method)
    if len(methods) > 1:
        rank = {id(m): i for i, m in enumerate(methods)}
        order = sorted(range(len(plan.requests)), key=lambda i: rank[id(plan.requests[i].method)])
        plan.requests = [plan.requests[i] for i in order]
        plan.num_new_tokens = [plan.num_new_tokens[i] for i in order]
    return methods


def _split(batch: ForwardBatch, methods: list[Any], logits_rows: list[int]) -> list[MethodGroup]:
    groups, i, t = [], 0, 0
    for method in methods:
        j = i
        while j < len(batch.requests) and batch.requests[j].method is method:
            j += 1
        stop = t + sum(batch.num_new_tokens[i:j])
        members = set(map(id, batch.requests[i:j]))
        sub = ForwardBatch(
            requests=batch.requests[i:j], num_new_tokens=batch.num_new_tokens[i:j],
            input_ids=batch.input_ids[t:stop], positions=batch.positions[t:stop],
            slot_mapping=batch.slot_mapping[..., t:stop],
            view=batch.view.rows(i, j, t),
            layer_views=None if batch.layer_views is None else [v.rows(i, j, t) for v in batch.layer_views],
            logits_indices=torch.tensor([r - t for r in logits_rows if t <= r < stop], dtype=torch.int64,
                                        device=batch.input_ids.device),
            sample_requests=[r for r in batch.sample_requests if id(r) in members],
            finished_prompt=[r for r in batch.finished_prompt if id(r) in members],
            cache=batch.cache, probe=batch.probe, method=method,
        )
        groups.append(MethodGroup(method, sub, t, stop))
        i, t = j, stop
    return groups


def build_forward_batch(plan: StepPlan, cache: CacheManager, device: torch.device) -> ForwardBatch:
    methods = order_by_method(plan)
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
    batch = ForwardBatch(
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
        method=methods[0] if len(methods) == 1 else None,
    )
    if len(methods) > 1:
        batch.groups = _split(batch, methods, logits_indices)
    return batch


def next_decode_step(batch: ForwardBatch, tokens: torch.Tensor, block_tables: torch.Tensor | None = None
                     ) -> ForwardBatch:
    """The decode step after ``batch`` (every row one decoding request), built on the device from the tokens
    ``batch`` sampled (``tokens`` [B] int64): each request's next token at the next logical position, written
    to its next physical slot in every layer through its page table (whose pages must already cover it;
    ``block_tables``: the requests' tables when pages were added after ``batch``, each row starting with the
    pages it had). No host sync; the host-side lengths advance by one. Per-layer views (layers of different
    lengths, a codec's layers) advance each; under a codec with windows the codes' lengths follow ``quant_len``
    (and the cache plans the step's window writes: ``CacheManager.plan_decode_writes``)."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)

    def next_slots(view: PagedView) -> torch.Tensor:
        nxt = view.kv_lens.long()  # physical index of the next slot (== its logical position unless compacted)
        tables = view.block_tables if block_tables is None else block_tables
        return tables[rows, nxt // view.page_size].long() * view.page_size + nxt % view.page_size

    def advance(view: PagedView) -> PagedView:
        fields = {"kv_lens": view.kv_lens + 1, "kv_lens_cpu": [n + 1 for n in view.kv_lens_cpu]}
        if block_tables is not None:
            fields["block_tables"] = block_tables
        if isinstance(view, QuantizedPagesView):
            if view.window_k is None:  # every slot from codes
                fields.update(quant_lens=fields["kv_lens"], quant_lens_cpu=fields["kv_lens_cpu"])
            else:  # a decoding request holds a window: its codes reach quant_len(n)
                fields.update(quant_lens=view.codec.quant_lens(fields["kv_lens"]),
                              quant_lens_cpu=[view.codec.quant_len(n) for n in fields["kv_lens_cpu"]])
        return dataclasses.replace(view, **fields)

    if batch.slot_mapping.dim() == 2:  # layers of different physical lengths
        slot_mapping = torch.stack([next_slots(v) for v in batch.layer_views])
    else:
        slot_mapping = next_slots(batch.view)
    layer_views = None if batch.layer_views is None else [advance(v) for v in batch.layer_views]
    view = layer_views[0] if layer_views is not None else advance(batch.view)
    return dataclasses.replace(batch, input_ids=tokens, positions=batch.positions + 1, slot_mapping=slot_mapping,
                               view=view, layer_views=layer_views, scratch={})

