"""OmniKV (Hao et al. 2025, "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs").

Storage is untouched; a few *observation* layers choose which tokens the following layers read.

At a decode step (one new token that is not part of the prompt), per request:

* layers before the first observation layer run dense (the derived ``dense_layers``);
* an observation layer runs full attention, and from the current query and the layer's cached keys it
  computes the attention probabilities ``softmax(q_h . k / sqrt(D))`` over every resident slot, per query
  head ``h``, and sums them over all query heads into one score per slot (the view is per request, so one
  token set serves every head); the request's newest token plus the top ``token_budget - 1`` of its other
  slots are chosen and kept in ``batch.scratch`` for this step;
* every layer after an observation layer, up to the next one, attends only to the chosen slots through a
  ``SelectedSlotsView`` (slots in increasing logical order, the new token last).

A request with ``<= token_budget`` tokens (new token included) reads everything, and prefill chunks run
dense. Selection assumes every layer holds the same slots (the default paged cache, no compaction).

Steps with prompt tokens choose on the host (index lists, one host->device copy). Steps where every request
decodes choose on the device with fixed shapes (``_choose_decode``: every row lists ``token_budget`` slots,
short rows padded past their count, plus a one-slot-page table for GPU kernels), which is what a decode CUDA
graph captures: such steps may replay (``decode_capabilities``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, PagedView, SelectedSlotsView, SparseMethod, all_reduce
from engine.contract.method import DecodeCapabilities
from engine.errors import ConfigError
from engine.registry import register_method
from agentrt_kernels.dispatch import paged_decode_logits
from policies.scoring import all_rows_decode, check_int, view_slots

SCRATCH_KEY = "omnikv"


@dataclass(slots=True, frozen=True)
class OmniKVConfig:
    observation_layers: tuple[int, ...] = (1,)  # layers that run full attention and choose the tokens
    token_budget: int = 1024  # tokens the layers after an observation layer read per request

    def __post_init__(self) -> None:
        layers = self.observation_layers
        if not isinstance(layers, (tuple, list)) or not layers:
            raise ValueError(f"observation_layers must be a non-empty sequence of layer indices, got {layers!r}")
        for layer in layers:
            check_int("each observation layer", layer, 0)
        if any(a >= b for a, b in zip(layers, layers[1:])):
            raise ValueError(f"observation_layers must be strictly increasing, got {layers!r}")
        object.__setattr__(self, "observation_layers", tuple(layers))
        check_int("token_budget", self.token_budget, 1)

    @property
    def dense_layers(self) -> int:
        """Layers before the first observation layer: they run dense."""
        return self.observation_layers[0]


def _is_decode(req, query_len: int) -> bool:
    return query_len == 1 and req.num_computed_tokens >= req.num_prompt_tokens


_PROMPT = DecodeCapabilities(replay=False, graph_hooks=True)  # a request still in its prompt


@register_method
class OmniKV(SparseMethod):
    name = "omnikv"
    family = Family.SELECTION
    Config = OmniKVConfig
    view_types = (PagedView, SelectedSlotsView)
    decode = DecodeCapabilities(graph_hooks=True)  # pure-decode steps select inside the captured graph

    def validate(self, spec):
        last = self.config.observation_layers[-1]
        if last >= spec.num_layers:
            raise ConfigError(
                f"method 'omnikv': observation layer {last} does not exist (the model has {spec.num_layers} layers)"
            )

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """A decode step's selection is device work over the batch alone; a prompt chunk chooses on the host."""
        return self.decode if req.num_computed_tokens >= req.num_prompt_tokens else _PROMPT

    _all_decode = staticmethod(all_rows_decode)

    def select(self, layer: int, q: torch.Tensor, batch):
        view = batch.view_for(layer)
        if layer < self.config.dense_layers:
            return view
        if layer in self.config.observation_layers:
            choose = self._choose_decode if self._all_decode(batch) else self._choose
            batch.scratch[SCRATCH_KEY] = choose(layer, q, batch, view)
            return view
        chosen = batch.scratch.get(SCRATCH_KEY)
        return view if chosen is None else chosen

    def _choose(self, layer: int, q: torch.Tensor, batch, view) -> SelectedSlotsView | None:
        budget, ps = self.config.token_budget, view.page_size
        rows: list[int] = []
        query_rows: list[int] = []
        start = 0
        for i, (req, n, length) in enumerate(zip(batch.requests, view.query_lens_cpu, view.kv_lens_cpu)):
            if _is_decode(req, n) and length > budget:
                rows.append(i)
                query_rows.append(start)
            start += n
        if not rows:
            return None
        device = q.device
        lengths = [view.kv_lens_cpu[i] for i in rows]
        width = max(lengths)
        selected_rows = set(rows)
        counts = [budget if i in selected_rows else length for i, length in enumerate(view.kv_lens_cpu)]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        s, b = len(rows), len(counts)  # one host->device copy for every per-step list (each copy syncs)
        packed = torch.tensor(rows + lengths + query_rows + counts + indptr, dtype=torch.long).to(device)
        rows_t, lens_t, query_rows_t = packed[:s], packed[s:2 * s], packed[2 * s:3 * s]
        counts_t, indptr_t = packed[3 * s:3 * s + b], packed[3 * s + b:]
        positions = torch.arange(width, device=device)
        slots = view_slots(view.block_tables, rows_t[:, None], positions[None, :], ps)  # [s, width]
        valid = positions[None, :] < lens_t[:, None]
        slots = torch.where(valid, slots, 0)
        k_cache, _ = batch.cache.layer_kv(layer)
        qs = q[query_rows_t]  # [s, Hq, D]
        logits = paged_decode_logits(qs, k_cache, view.block_tables[rows_t], lens_t.to(torch.int32), lengths,
                                     qs.shape[-1] ** -0.5, width)  # [s, Hq, width], -inf past each length
        probs = torch.softmax(logits, dim=-1)
        scores = all_reduce(probs.sum(dim=1), "sum")  # [s, width]: attention mass over all query heads (all ranks)
        newest = lens_t - 1
        scores = scores.masked_fill(positions[None, :] >= newest[:, None], float("-inf"))
        top = scores.topk(budget - 1, dim=1).indices.sort(dim=1).values
        chosen = torch.cat([top, newest[:, None]], dim=1)  # [s, budget] logical positions, newest last
        chosen_slots = slots.gather(1, chosen)

        if s == b:
            slot_indices = chosen_slots.flatten()
        else:
            pieces: list[torch.Tensor] = []
            selected = dict(zip(rows, chosen_slots))
            for i, length in enumerate(view.kv_lens_cpu):
                pieces.append(selected[i] if i in selected else
                              view_slots(view.block_tables, i, torch.arange(length, device=device), ps))
            slot_indices = torch.cat(pieces)
        return SelectedSlotsView(
            block_tables=view.block_tables,
            kv_lens=counts_t.to(view.kv_lens.dtype),
            query_start_loc=view.query_start_loc,
            page_size=ps,
            kv_lens_cpu=counts,
            query_lens_cpu=view.query_lens_cpu,
            causal=view.causal,
            slot_indptr=indptr_t,
            slot_indices=slot_indices,
        )

    def _choose_decode(self, layer: int, q: torch.Tensor, batch, view) -> SelectedSlotsView:
        """The choice of a step whose rows all decode, with device ops of fixed shapes only."""
        budget, ps = self.config.token_budget, view.page_size
        bt = view.block_tables
        width = bt.shape[1] * ps
        rows = bt.shape[0]
        device = q.device
        lens = view.kv_lens.long()
        positions = torch.arange(width, device=device)
        k_cache, _ = batch.cache.layer_kv(layer)
        logits = paged_decode_logits(q, k_cache, bt, view.kv_lens, view.kv_lens_cpu, q.shape[-1] ** -0.5, width)
        scores = all_reduce(torch.softmax(logits, dim=-1).sum(dim=1), "sum")  # [B, width]
        newest = lens - 1
        scores = scores.masked_fill(positions[None, :] >= newest[:, None], float("-inf"))
        k = min(budget - 1, width)
        per_row = torch.clamp(newest, max=budget - 1)  # others kept: all of a short row's
        if k > 0:
            top = scores.topk(k, dim=1)
            kept = (torch.arange(k, device=device)[None, :] < per_row[:, None]) & (top.values > float("-inf"))
            picked = torch.where(kept, top.indices, width + top.indices).sort(dim=1).values
            count = kept.sum(dim=1)
        else:
            picked = torch.zeros(rows, 0, dtype=torch.long, device=device)
            count = torch.zeros_like(newest)
        chosen = torch.cat([picked, torch.zeros_like(newest)[:, None]], dim=1)  # [B, k + 1] logical positions
        chosen = torch.where(chosen >= width, 0, chosen)
        chosen.scatter_(1, count[:, None], newest[:, None])  # the new token right after the kept ones
        listed = count + 1
        slots = view_slots(bt, torch.arange(rows, device=device)[:, None], chosen, ps)
        slots = torch.where(torch.arange(k + 1, device=device)[None, :] < listed[:, None], slots, 0)
        return SelectedSlotsView(
            block_tables=bt,
            kv_lens=listed.to(view.kv_lens.dtype),
            query_start_loc=view.query_start_loc,
            page_size=ps,
            kv_lens_cpu=[min(n, budget) for n in view.kv_lens_cpu],  # ``listed`` on the host, no sync
            query_lens_cpu=view.query_lens_cpu,
            causal=view.causal,
            slot_indptr=torch.arange(rows + 1, device=device) * (k + 1),
            slot_indices=slots.flatten(),
            slot_table=slots.to(torch.int32),
        )
