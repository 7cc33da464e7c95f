"""RetroInfer-style selection (Chen et al. 2025, "RetroInfer: A Vector-Storage Approach for Scalable
Long-Context LLM Inference"): a per-request cluster index over the prompt's keys; at decode the top clusters
are attended exactly, the next ones are estimated from their centroids and value sums, the rest dropped.

Index, per request, layer ``l >= dense_layers`` and KV head ``h``, built when the prompt is computed
(``end_step`` for ``batch.finished_prompt``; ``kv_loaded`` when the loaded KV covers the whole prompt):

* the first ``m = prompt_slots - window`` slots are clustered (the last ``window`` prompt slots and every
  later slot form the *recent* set, always attended exactly; no re-clustering during generation);
* Euclidean k-means (Lloyd) on the fp32 keys, ``C = ceil(m / cluster_size)`` clusters, initial centroids the
  keys of the evenly spaced slots ``floor(j * m / C)``, ``iters`` rounds of (assign each key to its nearest
  centroid, ties to the lower cluster id; move each centroid to the mean of its members, an empty cluster
  keeps its centroid). The stored assignment is the last round's, so each centroid is its members' mean;
  per cluster also ``count`` and ``value_sum`` (fp32).

Decode step (one new token past the prompt), query ``q`` of the GQA group of KV head ``h``, scale
``head_dim ** -0.5``:

* cluster score ``aggregate_g(q_g . centroid)`` over the group's query heads (``max`` or ``sum``); empty
  clusters rank last; ranking is a stable descending sort (ties to the lower cluster id);
* the top ``exact_clusters`` clusters' member slots plus the recent set are *exact*; the next
  ``estimated_clusters`` clusters are *estimated* as one pseudo-token each, key = centroid, value =
  value_sum / count, logit ``q . centroid * scale + log(count)``; the other clusters are dropped;
* per query head: ``softmax([exact logits ; estimated logits]) @ [exact values ; mean values]`` in fp32.

Storage is untouched and prefill runs dense. The computation runs in ``after_attention``, which overwrites
the backend's output rows of the decode requests that have an index (``select`` returns the plain view and
stashes ``q``; when every row of a step is such a decode row it returns a view of each request's newest
slot only, so the backend's pass, which is overwritten, reads almost nothing). On the CPU it is the torch
reference above over every slot of the request (``attend``); where ``agentrt_kernels.ops.uses_triton`` (a GPU:
``attend_paged``) the exact part is ``ops.cluster_decode_partials``, which reads only the chosen
clusters' member slots (the index keeps each head's slots grouped by cluster: ``members``, ``offsets``) and
the recent range, and its per-split log-sum-exps are merged with the estimated clusters in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.contract import Family, SparseMethod
from engine.contract.method import HOOKS_EVERY_STEP
from engine.contract.view import PagedView, SelectedSlotsView
from engine.errors import ConfigError
from engine.registry import register_method
from agentrt_kernels import ops
from policies.scoring import check_int, view_slots

AGGREGATES = ("max", "sum")
SCRATCH_KEY = "retroinfer_q"
_ASSIGN_CHUNK = 8192  # keys per distance block (bounds the [H, chunk, C] distance matrix)


@dataclass(slots=True, frozen=True)
class RetroInferConfig:
    cluster_size: int = 16  # mean tokens per cluster: C = ceil(clustered tokens / cluster_size)
    iters: int = 4  # Lloyd iterations
    exact_clusters: int = 64  # clusters attended exactly at decode
    estimated_clusters: int = 256  # next clusters estimated from centroid and value sum
    window: int = 64  # last prompt tokens kept out of the index (attended exactly, like generated ones)
    dense_layers: int = 2  # the first layers run dense
    aggregate: str = "max"  # how a GQA group's query heads combine into one cluster score

    def __post_init__(self) -> None:
        check_int("cluster_size", self.cluster_size, 1)
        check_int("iters", self.iters, 1)
        check_int("exact_clusters", self.exact_clusters, 0)
        check_int("estimated_clusters", self.estimated_clusters, 0)
        check_int("window", self.window, 0)
        check_int("dense_layers", self.dense_layers, 0)
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")


@dataclass(slots=True)
class ClusterIndex:
    """One layer's index of one request: slots ``< num_clustered`` are clustered, the rest are recent."""

    num_clustered: int
    assign: torch.Tensor  # [Hkv, m] int64 cluster of each clustered slot
    centroids: torch.Tensor  # [Hkv, C, D] fp32
    counts: torch.Tensor  # [Hkv, C] fp32 members per cluster
    value_sum: torch.Tensor  # [Hkv, C, D] fp32
    members: torch.Tensor  # [Hkv, m] int32 clustered slots grouped by cluster (ascending slots within one)
    offsets: torch.Tensor  # [Hkv, C + 1] int32 cluster c of head h is members[h, offsets[h, c]:offsets[h, c + 1]]


def _nearest(keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """[H, m] index of each key's nearest centroid (squared Euclidean; ||k||^2 is constant per key)."""
    c_norm = (centroids * centroids).sum(-1)[:, None, :]
    parts = [(c_norm - 2 * chunk @ centroids.transpose(1, 2)).argmin(-1)
             for chunk in keys.split(_ASSIGN_CHUNK, dim=1)]
    return torch.cat(parts, dim=1)


def kmeans(keys: torch.Tensor, num_clusters: int, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per head on ``keys`` [H, m, D] fp32 -> (assign [H, m], centroids [H, C, D], counts [H, C])."""
    h, m, d = keys.shape
    init = torch.arange(num_clusters, device=keys.device) * m // num_clusters
    centroids = keys[:, init].clone()
    for _ in range(iters):
        assign = _nearest(keys, centroids)
        sums = keys.new_zeros(h, num_clusters, d).scatter_add_(1, assign[..., None].expand(-1, -1, d), keys)
        counts = keys.new_zeros(h, num_clusters).scatter_add_(1, assign, keys.new_ones(h, m))
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
    return assign, centroids, counts


def _is_decode(req, query_len: int) -> bool:
    return query_len == 1 and req.num_computed_tokens >= req.num_prompt_tokens


def _newest_slot_view(view: PagedView) -> SelectedSlotsView:
    """The backend's pass over only each request's newest slot (one-slot lists built on the device)."""
    rows = len(view.kv_lens_cpu)
    device = view.block_tables.device
    newest = (view.kv_lens.long() - 1)[:, None]
    slots = view_slots(view.block_tables, torch.arange(rows, device=device)[:, None], newest, view.page_size)
    return SelectedSlotsView(
        block_tables=view.block_tables, kv_lens=torch.ones_like(view.kv_lens), query_start_loc=view.query_start_loc,
        page_size=view.page_size, kv_lens_cpu=[1] * rows, query_lens_cpu=view.query_lens_cpu, causal=view.causal,
        slot_indptr=torch.arange(rows + 1, device=device), slot_indices=slots.flatten(),
        slot_table=slots.to(torch.int32))


@register_method
class RetroInfer(SparseMethod):
    name = "retroinfer"
    family = Family.SELECTION
    Config = RetroInferConfig
    view_types = (PagedView, SelectedSlotsView)  # SelectedSlotsView: the newest slot only, when all rows are rewritten
    decode = HOOKS_EVERY_STEP  # after_attention recomputes decode rows in a per-request host loop

    def __init__(self, config: RetroInferConfig | None = None):
        super().__init__(config)
        self._index: dict[str, list[ClusterIndex]] = {}  # request id -> one index per layer >= dense_layers

    # --- index ----------------------------------------------------------------------------------
    def validate(self, spec) -> None:
        if spec.v_head_dim != spec.head_dim:
            raise ConfigError(f"retroinfer keeps value sums per key cluster and gathers values as wide as keys; this "
                              f"model's values ({spec.v_head_dim}) are narrower than its keys ({spec.head_dim}), "
                              "a latent (MLA) cache")

    def build_index(self, req, cache) -> None:
        cfg, ps = self.config, cache.page_size
        layers: list[ClusterIndex] = []
        for layer in range(cfg.dense_layers, cache.spec.num_layers):
            m = min(cache.physical_len(req, layer), req.num_prompt_tokens) - cfg.window
            if m < 1:
                self._index.pop(req.request_id, None)
                return
            pages = torch.tensor(cache.table(req).pages, dtype=torch.int32, device=cache.spec.device)
            slots = view_slots(pages[None], 0, torch.arange(m, device=pages.device), ps)
            k_cache, v_cache = cache.layer_kv(layer)
            keys = k_cache.flatten(0, 1)[slots].float().transpose(0, 1).contiguous()  # [Hkv, m, D]
            values = v_cache.flatten(0, 1)[slots].float().transpose(0, 1)
            assign, centroids, counts = kmeans(keys, -(-m // cfg.cluster_size), cfg.iters)
            d = values.shape[-1]
            value_sum = values.new_zeros(centroids.shape).scatter_add_(1, assign[..., None].expand(-1, -1, d), values)
            members = assign.argsort(dim=1, stable=True).to(torch.int32)
            offsets = torch.nn.functional.pad(counts.long().cumsum(1), (1, 0)).to(torch.int32)
            layers.append(ClusterIndex(m, assign, centroids, counts, value_sum, members, offsets))
        self._index[req.request_id] = layers

    def end_step(self, batch) -> None:
        for req in batch.finished_prompt:
            self.build_index(req, batch.cache)

    def kv_loaded(self, req, cache) -> None:
        if cache.physical_len(req) >= req.num_prompt_tokens:
            self.build_index(req, cache)

    def release(self, req) -> None:
        self._index.pop(req.request_id, None)

    def export_state(self, req):
        return self._index.get(req.request_id)

    def import_state(self, req, state) -> None:
        if state is not None:
            self._index[req.request_id] = state

    # --- decode ---------------------------------------------------------------------------------
    def select(self, layer: int, q: torch.Tensor, batch):
        batch.scratch[SCRATCH_KEY] = q
        view = batch.view_for(layer)
        if layer < self.config.dense_layers or not self._all_rows_overwritten(batch, view):
            return view
        return _newest_slot_view(view)

    def _all_rows_overwritten(self, batch, view) -> bool:
        """Whether every row of the step is a decode row with an index (``after_attention`` rewrites them
        all, so the backend need only attend to each request's newest slot); decided once per step."""
        key = SCRATCH_KEY + "_all"
        if key not in batch.scratch:
            batch.scratch[key] = all(
                req.request_id in self._index and _is_decode(req, n)
                for req, n in zip(batch.requests, view.query_lens_cpu))
        return batch.scratch[key]

    def after_attention(self, layer, batch, out, scores) -> None:
        if layer < self.config.dense_layers or not self._index:
            return
        view = batch.view_for(layer)
        q = batch.scratch[SCRATCH_KEY]
        k_cache, v_cache = batch.cache.layer_kv(layer)
        row = 0
        for i, (req, n) in enumerate(zip(batch.requests, view.query_lens_cpu)):
            index = self._index.get(req.request_id)
            if index is not None and _is_decode(req, n):
                layer_index = index[layer - self.config.dense_layers]
                if ops.uses_triton(q):
                    out[row] = self.attend_paged(q[row], k_cache, v_cache, view.block_tables[i],
                                                 view.kv_lens_cpu[i], layer_index)
                else:
                    slots = view_slots(view.block_tables, i, torch.arange(view.kv_lens_cpu[i], device=q.device),
                                       view.page_size)
                    keys = k_cache.flatten(0, 1)[slots].float()
                    values = v_cache.flatten(0, 1)[slots].float()
                    out[row] = self.attend(q[row].float(), keys, values, layer_index)
            row += n

    def _rank(self, qg: torch.Tensor, index: ClusterIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact [Hkv, X], estimated [Hkv, E]) cluster ids for the query groups ``qg`` [Hkv, G, D] fp32."""
        cfg = self.config
        per_head = torch.einsum("hgd,hcd->hgc", qg, index.centroids)
        cluster_score = per_head.amax(1) if cfg.aggregate == "max" else per_head.sum(1)
        cluster_score = cluster_score.masked_fill(index.counts == 0, float("-inf"))
        order = cluster_score.sort(dim=1, descending=True, stable=True).indices
        n_exact = min(cfg.exact_clusters, order.shape[1])
        return order[:, :n_exact], order[:, n_exact:n_exact + cfg.estimated_clusters]

    @staticmethod
    def _estimates(qg: torch.Tensor, index: ClusterIndex, estimated: torch.Tensor, scale: float):
        """Estimated clusters as pseudo-tokens: (logits [Hkv, G, E], mean values [Hkv, E, D])."""
        d = qg.shape[-1]
        count = index.counts.gather(1, estimated)  # [Hkv, E]
        centroid = index.centroids.gather(1, estimated[..., None].expand(-1, -1, d))
        mean_value = index.value_sum.gather(1, estimated[..., None].expand(-1, -1, d)) / count.clamp(min=1)[..., None]
        return torch.einsum("hgd,hed->hge", qg, centroid) * scale + count.log()[:, None, :], mean_value

    def attend_paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, kv_len: int, index: ClusterIndex) -> torch.Tensor:
        """``attend`` reading the paged cache in place: the exact clusters and the recent range through the
        cluster-gather kernel (Triton; the interpreter on CPU), merged with the estimates -> [Hq, D] fp32."""
        hkv, d = index.centroids.shape[0], q.shape[-1]
        scale = d**-0.5
        qg = q.float().view(hkv, -1, d)
        exact, estimated = self._rank(qg, index)
        o, lse = ops.cluster_decode_partials(q.contiguous(), k_cache, v_cache, block_table, index.members,
                                             index.offsets, exact.to(torch.int32).contiguous(), index.num_clustered,
                                             kv_len, scale)
        est_logits, mean_value = self._estimates(qg, index, estimated, scale)
        parts = torch.cat([lse, est_logits.reshape(q.shape[0], -1)], dim=1)  # [Hq, splits + E]
        weights = (parts - parts.amax(1, keepdim=True)).exp()  # the recent range is never empty: finite max
        w_split, w_est = weights[:, : lse.shape[1]], weights[:, lse.shape[1]:]
        est_out = torch.einsum("hge,hed->hgd", w_est.reshape(hkv, q.shape[0] // hkv, -1), mean_value).reshape(-1, d)
        return ((w_split[..., None] * o).sum(1) + est_out) / weights.sum(1, keepdim=True)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: ClusterIndex) -> torch.Tensor:
        """One decode query ``q`` [Hq, D] over a request's ``keys``/``values`` [n, Hkv, D] -> [Hq, D] fp32."""
        n, hkv, d = keys.shape
        qg = q.view(hkv, -1, d)
        scale = d**-0.5
        exact_ids, estimated = self._rank(qg, index)
        exact = torch.zeros(hkv, index.counts.shape[1], dtype=torch.bool, device=q.device)
        exact.scatter_(1, exact_ids, True)
        visible = torch.ones(hkv, n, dtype=torch.bool, device=q.device)
        visible[:, : index.num_clustered] = exact.gather(1, index.assign)

        logits = torch.einsum("hgd,nhd->hgn", qg, keys) * scale
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        est_logits, mean_value = self._estimates(qg, index, estimated, scale)
        probs = torch.softmax(torch.cat([logits, est_logits], dim=-1), dim=-1)
        o = torch.einsum("hgn,nhd->hgd", probs[..., :n], values)
        o = o + torch.einsum("hge,hed->hgd", probs[..., n:], mean_value)
        return o.reshape(-1, d)

