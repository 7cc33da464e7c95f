"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Storage is untouched; at decode each layer reads only the pages most likely to matter for the current query.

Metadata: for every page and every (layer, KV head) the elementwise min and max of its keys, kept in tensors
``[num_selected_layers, num_pages, Hkv, D]`` indexed by *physical page id* (so pages shared through the
prefix cache carry their metadata with them). It is maintained incrementally: in ``select`` (after the
step's KV write) the bounds of every page touched by the step's tokens are recomputed from that page's
written slots. The tensors are allocated on first use and cost ``1 / page_size`` of the KV memory, outside
the page pool's budget.

Selection, per request and layer, at a decode step (one new token that is not part of the prompt):

* per query head ``h`` (reading KV head ``h // group``) the page score is Quest's upper bound
  ``U_h(page) = sum_d max(q_d * min_d, q_d * max_d)``;
* the view is per request, not per head, so the heads are aggregated into one score per page:
  ``aggregate="max"`` (default) takes ``max_h U_h(page)``, an upper bound on the largest logit any head can
  have in the page; ``aggregate="sum"`` takes ``sum_h U_h(page)``;
* the ``token_budget // page_size`` pages read are the request's last (possibly partial) page plus the
  top-scoring ``token_budget // page_size - 1`` of its other pages.

A request reads everything when it has ``<= token_budget`` tokens (new token included) or no more pages
than the budget allows; the first ``dense_layers`` layers and every prefill chunk run dense. The returned
``SelectedPagesView`` lists the selected pages in increasing logical order, the last page last, with
``kv_lens`` = the number of selected slots, so the backend's causal / last-page semantics hold unchanged.

Two implementations of the same selection. Steps with prompt tokens plan on the host (``_plan``: index
lists, one host->device copy). Steps where every request decodes select on the device alone
(``_select_decode``: the new key widens its page's bounds in place, every column of the step's page table
is scored, the per-row top pages are kept with fixed shapes), which is what a decode CUDA graph captures:
such steps may replay (``decode_capabilities``), and the graph replays the selection. The tests check both
against the paper-definition reference and against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, PagedView, SelectedPagesView, SparseMethod, all_reduce
from engine.contract.method import DecodeCapabilities
from engine.errors import ConfigError
from engine.registry import register_method
from agentrt_kernels import ops
from agentrt_kernels.torch_ref.quest import AGGREGATES, page_key_bounds
from policies.scoring import all_rows_decode, check_int


@dataclass(slots=True, frozen=True)
class QuestConfig:
    token_budget: int = 1024  # tokens read per request and layer at decode (token_budget // page_size pages)
    dense_layers: int = 2  # the first layers run dense
    aggregate: str = "max"  # how query heads combine into one page score: "max" or "sum"

    def __post_init__(self) -> None:
        check_int("token_budget", self.token_budget, 1)
        check_int("dense_layers", self.dense_layers, 0)
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")


@dataclass(slots=True)
class _StepPlan:
    """What every layer of one step shares: the pages the step touched and the decode rows to select for."""

    view: object
    touched_pages: torch.Tensor  # [n] physical page ids written this step
    touched_valid: torch.Tensor  # [n] written slots of each touched page (after this step's write)
    rows: list[int]  # requests that select
    rows_t: torch.Tensor
    query_rows: torch.Tensor  # [len(rows)] the decode query of each selecting request
    num_pages: list[int]  # resident pages of each selecting request
    last_page: torch.Tensor  # [len(rows)] logical index of each selecting request's last page
    kv_lens_cpu: list[int]  # every request's slots read by a selecting layer
    kv_lens: torch.Tensor  # the same on the device (built once per step: a host->device copy syncs)


def _is_decode(req, query_len: int) -> bool:
    return query_len == 1 and req.num_computed_tokens >= req.num_prompt_tokens


_PROMPT = DecodeCapabilities(replay=False, graph_hooks=True)  # a request still in its prompt


@register_method
class Quest(SparseMethod):
    name = "quest"
    family = Family.SELECTION
    Config = QuestConfig
    view_types = (PagedView, SelectedPagesView)
    decode = DecodeCapabilities(graph_hooks=True)  # pure-decode steps select inside the captured graph

    def __init__(self, config: QuestConfig | None = None):
        super().__init__(config)
        self._kmin: torch.Tensor | None = None  # [num_layers - dense_layers, num_pages, Hkv, D]
        self._kmax: torch.Tensor | None = None

    def validate(self, spec):
        if self.config.token_budget < spec.page_size:
            raise ConfigError(
                f"method 'quest': token_budget ({self.config.token_budget}) must hold at least one page "
                f"(page_size {spec.page_size})"
            )

    # --- metadata -------------------------------------------------------------------------------
    def kv_loaded(self, req, cache) -> None:
        """Recompute the min/max bounds of every page the request holds, in every selected layer."""
        n, ps = cache.physical_len(req), cache.page_size
        pages = cache.table(req).pages[: -(-n // ps)]
        device = cache.spec.device
        page_ids = torch.tensor(pages, dtype=torch.long, device=device)
        valid = torch.tensor([min(ps, n - i * ps) for i in range(len(pages))], device=device)
        for layer in range(self.config.dense_layers, cache.spec.num_layers):
            k_cache, _ = cache.layer_kv(layer)
            kmin_all, kmax_all = self._bounds(cache, k_cache)
            lo, hi = page_key_bounds(k_cache, page_ids, valid)
            kmin_all[layer - self.config.dense_layers][page_ids] = lo
            kmax_all[layer - self.config.dense_layers][page_ids] = hi

    def bind(self, cache) -> None:
        k_cache, _ = cache.layer_kv(0)
        self._bounds(cache, k_cache)  # allocated before any decode graph is captured (capture must not allocate)

    def decode_capabilities(self, req) -> DecodeCapabilities:
        """A decode step's selection is device work over the batch alone; a prompt chunk plans on the host."""
        return self.decode if req.num_computed_tokens >= req.num_prompt_tokens else _PROMPT

    _all_decode = staticmethod(all_rows_decode)

    def _bounds(self, cache, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_layers = max(cache.spec.num_layers - self.config.dense_layers, 0)
        shape = (num_layers, *k_cache.shape[:1], *k_cache.shape[2:])
        if self._kmin is None or self._kmin.shape != shape or self._kmin.device != k_cache.device:
            self._kmin = torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device)
            self._kmax = torch.zeros(shape, dtype=k_cache.dtype, device=k_cache.device)
        return self._kmin, self._kmax

    def _plan(self, batch, view) -> _StepPlan:
        plan = batch.scratch.get("quest")
        if plan is not None and plan.view is view:
            return plan
        ps, budget = view.page_size, self.config.token_budget
        max_selected = budget // ps
        t_rows: list[int] = []
        t_cols: list[int] = []
        t_valid: list[int] = []
        rows: list[int] = []
        query_rows: list[int] = []
        num_pages: list[int] = []
        selected_lens: list[int] = []
        start = 0
        for i, (req, n, length) in enumerate(zip(batch.requests, view.query_lens_cpu, view.kv_lens_cpu)):
            for page in range((length - n) // ps, (length - 1) // ps + 1):
                t_rows.append(i)
                t_cols.append(page)
                t_valid.append(min(ps, length - page * ps))
            pages = -(-length // ps)
            if _is_decode(req, n) and length > budget and pages > max_selected:
                rows.append(i)
                query_rows.append(start)
                num_pages.append(pages)
                selected_lens.append((max_selected - 1) * ps + length - (pages - 1) * ps)
            start += n
        device = view.block_tables.device
        kv_lens_cpu = list(view.kv_lens_cpu)
        for i, n in zip(rows, selected_lens):
            kv_lens_cpu[i] = n
        k, r = len(t_rows), len(rows)  # one host->device copy for every per-step index list
        packed = torch.tensor(t_rows + t_cols + t_valid + rows + query_rows + [p - 1 for p in num_pages]
                              + kv_lens_cpu, dtype=torch.long).to(device)
        touched = view.block_tables[packed[:k], packed[k:2 * k]]
        plan = _StepPlan(
            view=view,
            touched_pages=touched.long(),
            touched_valid=packed[2 * k:3 * k],
            rows=rows,
            rows_t=packed[3 * k:3 * k + r],
            query_rows=packed[3 * k + r:3 * k + 2 * r],
            num_pages=num_pages,
            last_page=packed[3 * k + 2 * r:3 * k + 3 * r],
            kv_lens_cpu=kv_lens_cpu,
            kv_lens=packed[3 * k + 3 * r:].to(view.kv_lens.dtype),
        )
        batch.scratch["quest"] = plan
        return plan

    # --- hooks ----------------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, batch):
        view = batch.view_for(layer)
        if layer < self.config.dense_layers:
            return view
        k_cache, _ = batch.cache.layer_kv(layer)
        kmin_all, kmax_all = self._bounds(batch.cache, k_cache)
        kmin_l, kmax_l = kmin_all[layer - self.config.dense_layers], kmax_all[layer - self.config.dense_layers]
        decode = batch.scratch.get("quest_decode")
        if decode is None:  # one answer per step, not per layer
            decode = batch.scratch["quest_decode"] = self._all_decode(batch)
        if decode:
            return self._select_decode(q, view, k_cache, kmin_l, kmax_l)
        plan = self._plan(batch, view)
        if plan.touched_pages.numel():
            lo, hi = page_key_bounds(k_cache, plan.touched_pages, plan.touched_valid)
            kmin_l[plan.touched_pages] = lo
            kmax_l[plan.touched_pages] = hi
        if not plan.rows:
            return view

        ps = view.page_size
        max_selected = self.config.token_budget // ps
        width = max(plan.num_pages)
        device = view.block_tables.device
        pages = view.block_tables[plan.rows_t, :width].long()  # [s, width] resident pages, logical order
        scores = ops.quest_page_scores(q[plan.query_rows], kmin_l, kmax_l, pages, self.config.aggregate)
        scores = all_reduce(scores, self.config.aggregate)  # over the query heads of other tensor-parallel ranks
        last = plan.last_page
        candidate = torch.arange(width, device=device)[None, :] < last[:, None]  # every page but the last
        scores = scores.masked_fill(~candidate, float("-inf"))
        top = scores.topk(max_selected - 1, dim=1).indices.sort(dim=1).values
        chosen = torch.cat([top, last[:, None]], dim=1)  # [s, max_selected], increasing, last page last
        block_tables = view.block_tables.clone()
        block_tables[plan.rows_t] = 0
        block_tables[plan.rows_t, :max_selected] = pages.gather(1, chosen).to(block_tables.dtype)
        return SelectedPagesView(
            block_tables=block_tables,
            kv_lens=plan.kv_lens,
            query_start_loc=view.query_start_loc,
            page_size=ps,
            kv_lens_cpu=plan.kv_lens_cpu,
            query_lens_cpu=view.query_lens_cpu,
            causal=view.causal,
        )

    def _select_decode(self, q, view, k_cache, kmin_l, kmax_l, fused: bool | None = None) -> SelectedPagesView:
        """The selection of a step whose rows all decode, with device ops of fixed shapes only: the new key widens
        its page's bounds and every page before a row's last is scored (``ops.quest_decode_scores``), the per-row
        top pages are kept and the table built (``ops.quest_decode_table``). ``fused`` (default: on a GPU): those
        two as Triton launches around the top-k instead of ~50 small torch ops a layer."""
        fused = ops.uses_triton(q) if fused is None else fused
        ps, budget = view.page_size, self.config.token_budget
        bt, width = view.block_tables, view.block_tables.shape[1]
        max_selected = budget // ps
        keep = max(-(-budget // ps), max_selected) - 1  # most pages kept besides the last (short rows: all)
        scores = ops.quest_decode_scores(q, kmin_l, kmax_l, k_cache, bt, view.kv_lens, ps, self.config.aggregate,
                                         use_triton=fused)
        scores = all_reduce(scores, self.config.aggregate)  # over the query heads of other tensor-parallel ranks
        top = scores.topk(min(keep, width), dim=1)
        block_tables, kv_lens = ops.quest_decode_table(top.values, top.indices, bt, view.kv_lens, ps, budget,
                                                       max_selected - 1, use_triton=fused)
        return SelectedPagesView(
            block_tables=block_tables,
            kv_lens=kv_lens,
            query_start_loc=view.query_start_loc,
            page_size=ps,
            kv_lens_cpu=[self._selected_len(n, ps) for n in view.kv_lens_cpu],  # ``kv_lens`` on the host, no sync
            query_lens_cpu=view.query_lens_cpu,
            causal=view.causal,
        )

    def _selected_len(self, n: int, ps: int) -> int:
        """Slots a decode row of ``n`` slots reads: every page before its last kept (all of them for a row of at
        most ``token_budget`` tokens, else ``token_budget // page_size - 1``), plus the last page's slots."""
        budget = self.config.token_budget
        last = (n - 1) // ps
        kept = last if n <= budget else min(last, budget // ps - 1)
        return kept * ps + n - last * ps
