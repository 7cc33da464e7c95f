"""Shared pieces of the eviction methods: a request's slots and keys, the observation-window score of
SnapKV/PyramidKV, 1D pooling, a deterministic top-k, a per-request query stash and config checks.

Conventions (those of the engine): query head ``j`` reads KV head ``j // group`` (``repeat_interleave``),
keys in the cache are post-RoPE, and the attention scale is ``head_dim ** -0.5`` (the runner's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agentrt_kernels.dispatch import window_votes
from agentrt_kernels.ops import window_vote_inputs, window_votes_with
from engine.contract import CacheManager, reduce_over_query_heads

if TYPE_CHECKING:
    from engine.contract import Request

POOLINGS = ("max", "avg")


# --- config checks --------------------------------------------------------------------------------
def check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


# --- a request's slots and keys -------------------------------------------------------------------
def view_slots(block_tables: torch.Tensor, row: int | torch.Tensor, positions: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """Flat physical slots (``page * page_size + offset``) of slot ``positions`` of view row(s) ``row``."""
    return block_tables[row, positions // page_size].long() * page_size + positions % page_size


def request_slots(cache: CacheManager, req: Request, n: int) -> torch.Tensor:
    """[n] int64 flat slot ids (``page * page_size + offset``) of the request's first ``n`` physical slots."""
    ps = cache.page_size
    device = cache.spec.device
    # non-blocking: a blocking copy to the GPU would wait for its queue to drain (once a layer in a vote)
    pages = torch.tensor(cache.table(req).pages[: -(-n // ps)], dtype=torch.int64).to(device, non_blocking=True)
    idx = torch.arange(n, device=device)
    return pages[idx // ps] * ps + idx % ps


def gather_keys(cache: CacheManager, req: Request, layer: int, n: int) -> torch.Tensor:
    """[n, Hkv, D] the keys of the request's first ``n`` physical slots in ``layer``."""
    k_cache, _ = cache.layer_kv(layer)
    return k_cache.flatten(0, 1)[request_slots(cache, req, n)]


def keep_all(n: int, heads: int, device) -> torch.Tensor:
    return torch.arange(n, device=device).expand(heads, n)


# --- scoring --------------------------------------------------------------------------------------
def window_scores(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The observation-window vote of SnapKV, one row per KV head.

    q [w, Hq, D] window queries at logical positions ``q_pos`` [w]; keys [n, Hkv, D] at logical positions
    ``k_pos`` [Hkv, n]. Returns fp32 [Hkv, n]::

        A[j, i, s] = softmax_s( q_i^j . k_s^{j // g} / sqrt(D) ),  key s hidden from query i if k_pos[s] > q_pos[i]
        vote[h, s] = mean over the g query heads j of KV head h of  sum_i A[j, i, s]
    """
    w, hq, d = q.shape
    n, hkv, _ = keys.shape
    g = hq // hkv
    logits = torch.einsum("ihgd,shd->hgis", q.float().reshape(w, hkv, g, d), keys.float()) * d**-0.5
    hidden = k_pos[:, None, None, :] > q_pos[None, None, :, None]  # [Hkv, 1, w, n]
    probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    return reduce_over_query_heads(probs.sum(dim=2).mean(dim=1), "mean")


def held_window_scores(cache: CacheManager, req: Request, layer: int, q: torch.Tensor, q_pos: torch.Tensor,
                       k_pos: torch.Tensor, q_first: int | None = None) -> torch.Tensor:
    """``window_scores`` of the window rows ``q`` at ``q_pos`` over every slot ``req`` holds in ``layer``
    (logical positions ``k_pos`` [Hkv, n]). Where the window's rows are the layer's last slots (the same
    positions in every head, all other slots before them: a prompt's end, a chain turn that recomputed its
    window) slot order is causal order, and ``window_votes`` (on a GPU its kernels, no [w, n] probability
    matrix) reads the paged keys in place, or, for coded storage, the request's keys decoded once into
    contiguous pages; otherwise the keys are gathered and scored here in fp32. ``q_first``: the window's first
    logical position (its rows are contiguous), which lets the layout be told on the host from the table
    (``TableHandle.ordered_from``) instead of read off the device."""
    n, w = k_pos.shape[1], q.shape[0]
    voter = WindowVoter(cache, req)
    if q_first is not None:
        causal_order = voter.causal_order(layer, n, w, q_first)
    else:
        causal_order = (0 < w <= n and bool((k_pos[:, n - w:] == q_pos[None, :]).all())
                        and bool((k_pos[:, : n - w] < q_pos[0]).all()))
    if not causal_order:
        return window_scores(q, gather_keys(cache, req, layer, n), q_pos, k_pos)
    return voter.finish(voter.sums(layer, q, n), q)


# A vote's key-split log-sum-exp holds (max, sum) fp32 partials per 64-slot key tile, window row and query head of
# every layer voting in one call: at long contexts the layers vote in several calls that keep them under this.
VOTE_PARTIALS_BYTES = 64 << 20


class WindowVoter:
    """The window votes of one request where the window's rows are each layer's last slots (``causal_order``):
    the layers of one length together (``sums_of_layers``; on a GPU three kernels for all of them where the
    storage holds every layer's keys in one paged tensor), or one layer (``sums``)."""

    def __init__(self, cache: CacheManager, req: Request):
        self.cache, self.req = cache, req

    def causal_order(self, layer: int, n: int, w: int, q_first: int,
                     ordered_from: tuple[int, int] | None = None) -> bool:
        """Whether the ``w`` window rows from logical position ``q_first`` are the layer's last of ``n`` slots
        with every other slot before them (told on the host from the table's ordered tail, ``ordered_from`` if the
        caller has it)."""
        slot, pos = ordered_from or self.cache.table(self.req).ordered_from(layer)
        return 0 < w and n - w >= slot and q_first == pos + n - slot - w

    def sums(self, layer: int, q: torch.Tensor, n: int) -> torch.Tensor:
        """[Hkv, n] fp32: the probabilities the window rows ``q`` [w, Hq, D] put on each of the layer's ``n``
        slots, summed over the rows and each KV head's query heads (``finish`` makes it the vote)."""
        return self.sums_of_layers([layer], [q], n)[0]

    def sums_of_layers(self, layers: list[int], qs: list[torch.Tensor], n: int) -> torch.Tensor:
        """[len(layers), Hkv, n] fp32: ``sums`` of each layer's window rows ``qs[i]`` [w, Hq, D] over its ``n``
        slots. Where the storage holds every layer's keys in one paged tensor (``all_layer_keys``) the paged keys
        are read in place, the layers rows of one block table: three launches on a GPU for all of them (for as
        many as keep the log-sum-exp's partials under ``VOTE_PARTIALS_BYTES``). Otherwise (coded storage) each
        layer's keys are decoded once into contiguous pages and voted on there."""
        q0, ps = qs[0], self.cache.page_size
        w, hq, scale = q0.shape[0], q0.shape[1], q0.shape[-1] ** -0.5
        stacked = self.cache.all_layer_keys()
        if stacked is None:
            num_pages = -(-n // ps)
            pages = torch.arange(num_pages, dtype=torch.int32, device=q0.device)
            votes = []
            for layer, q in zip(layers, qs):
                keys = gather_keys(self.cache, self.req, layer, n)  # decoded (cache dtype), padded to whole pages
                if num_pages * ps > n:
                    keys = torch.cat([keys, keys.new_zeros(num_pages * ps - n, *keys.shape[1:])])
                votes.append(window_votes(q, keys.view(num_pages, ps, *keys.shape[1:]), pages, n, scale))
            return torch.stack(votes)
        keys, stride = stacked
        pages = self.cache.table(self.req).pages_tensor()[: -(-n // ps)]
        out = torch.empty(len(layers), keys.shape[2], n, dtype=torch.float32, device=q0.device)  # written whole
        per_call = max(1, VOTE_PARTIALS_BYTES // (-(-n // 64) * w * hq * 8))  # the partials: 64-slot key tiles
        for a in range(0, len(layers), per_call):
            part = layers[a:a + per_call]
            inputs = window_vote_inputs(pages, n, w, q0.device, [layer * stride for layer in part])
            q = torch.cat(qs[a:a + per_call]) if len(part) > 1 else qs[a]  # (a one-layer call copies nothing)
            window_votes_with(inputs, q, keys, scale, out=out[a:a + len(part)])
        return out

    @staticmethod
    def finish(sums: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``sums`` (one layer's [Hkv, n], or layers' stacked along the first dim) -> the vote: the mean over each
        KV head's query heads."""
        heads = sums.shape[-2] if sums.dim() == 2 else sums.shape[1]
        return reduce_over_query_heads(sums / (q.shape[1] // heads), "mean")


def pool1d(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """[H, n] -> [H, n]: 1D pooling over positions, stride 1, padding ``kernel_size // 2`` (odd kernel).

    ``max``: padding never wins (max_pool1d pads with -inf). ``avg``: the padding counts as zeros
    (``count_include_pad=True``, every output is a sum over ``kernel_size`` cells divided by ``kernel_size``),
    as in the SnapKV reference code."""
    if kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    x = scores[:, None, :]
    pad = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(x, kernel_size, stride=1, padding=pad)[:, 0]
    return F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=True)[:, 0]


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[H, n] -> [H, k] int64 indices of the k largest per row, returned in increasing index order.
    Ties go to the lower index (a stable descending sort), so pooled plateaus select deterministically."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def keep_voted_and_window(vote: torch.Tensor, k_pos: torch.Tensor, window_start: int, budget: int,
                          kernel_size: int, pooling: str, ordered_from: tuple[int, int] | None = None) -> torch.Tensor:
    """SnapKV's selection on held slots: [Hkv, n] vote and logical positions (increasing along each row) ->
    [Hkv, budget] kept slot indices, increasing. Each head keeps its window slots (logical position >=
    ``window_start``: a suffix of the row) plus the top ``budget - |window|`` of the other slots by their vote
    pooled over slot order. Needs ``n > budget >= |window|``. ``ordered_from``: the table's
    ``(slot, position)`` from ``TableHandle.ordered_from``; with the window inside that ordered tail its size is
    known on the host."""
    heads, n = vote.shape
    if ordered_from is not None and window_start >= ordered_from[1]:
        slot, pos = ordered_from
        counts = [max(0, min(n - slot, n - slot - (window_start - pos)))] * heads
    else:
        counts = (k_pos >= window_start).sum(dim=1).tolist()

    if len(set(counts)) == 1:  # the usual case; heads differ only where a chain's window was pruned
        return keep_top_and_window(vote, counts[0], budget, kernel_size, pooling)
    return torch.cat([keep_top_and_window(vote[h: h + 1], c, budget, kernel_size, pooling)
                      for h, c in enumerate(counts)])


def keep_top_and_window(vote: torch.Tensor, window: int, budget: int, kernel_size: int, pooling: str) -> torch.Tensor:
    """[R, n] votes of rows whose last ``window`` slots are their window -> [R, budget] kept slot indices,
    increasing: the top ``budget - window`` of the other slots by their vote pooled over slot order, then the
    window. Rows are independent (several heads, or several layers' heads stacked)."""
    n = vote.shape[-1]
    top = top_k_sorted(pool1d(vote[:, : n - window], kernel_size, pooling), budget - window)
    return torch.cat([top, torch.arange(n - window, n, device=vote.device).expand(vote.shape[0], window)], dim=1)


# --- per-request query stash ----------------------------------------------------------------------
class QueryStash:
    """The last ``size`` query rows a request computed (or more, see ``push``), per layer, at contiguous
    logical positions ``[start[layer], start[layer] + len)``.

    ``push`` appends a step's rows (logical positions ``first_pos, first_pos + 1, ...``). Stashed rows at
    positions >= ``first_pos`` (a history cut back, e.g. a chain resumed at an earlier point) are replaced, and
    rows before a gap are dropped, so the stash stays contiguous. ``export`` / ``load`` carry the rows from one
    turn of a chain to the next (a list of ``(start, rows)``: deep-copyable)."""

    __slots__ = ("size", "q", "start")

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.q: list[torch.Tensor | None] = [None] * num_layers
        self.start: list[int] = [0] * num_layers

    def push(self, layer: int, rows: torch.Tensor, first_pos: int, keep_from: int | None = None) -> None:
        """Append ``rows`` at positions ``first_pos ..``; beyond the last ``size`` rows, rows at positions >=
        ``keep_from`` are kept too (a window still waiting to be used)."""
        n = rows.shape[0]
        if n == 0:
            return
        rows = rows.detach()
        old, start = self.q[layer], self.start[layer]
        if old is not None and start <= first_pos <= start + old.shape[0]:
            rows, first_pos = torch.cat([old[: first_pos - start], rows]), start  # a new tensor
        else:
            rows = rows.clone()  # never keep the whole step's query tensor alive
        drop = max(0, rows.shape[0] - self.size)
        if keep_from is not None:
            drop = min(drop, max(0, keep_from - first_pos))
        self.q[layer], self.start[layer] = rows[drop:], first_pos + drop

    def rows_between(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stashed rows with logical position in [lo, hi) and those positions ([k, Hq, D], [k])."""
        rows = self.rows(layer, lo, hi)
        a = self.first_between(layer, lo, hi)
        return rows, torch.arange(a, a + rows.shape[0], device=rows.device)

    def rows(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """The stashed rows with logical position in [lo, hi) ([k, Hq, D]; from ``first_between``)."""
        q, start = self.q[layer], self.start[layer]
        if q is None:
            raise LookupError(f"no query stashed in layer {layer}")
        a, b = max(lo, start), min(hi, start + q.shape[0])
        return q[a - start: max(a, b) - start]

    def first_between(self, layer: int, lo: int, hi: int) -> int:
        """The first logical position ``rows_between(layer, lo, hi)`` returns (host arithmetic only)."""
        return max(lo, self.start[layer])

    def export(self) -> list[tuple[int, torch.Tensor | None]]:
        return list(zip(self.start, self.q))

    @classmethod
    def load(cls, exported: list[tuple[int, torch.Tensor | None]], size: int) -> QueryStash:
        stash = cls(len(exported), size)
        for layer, (start, q) in enumerate(exported):
            if q is not None:
                drop = max(0, q.shape[0] - size)
                stash.q[layer], stash.start[layer] = q[drop:], start + drop
        return stash


def request_rows(batch):
    """Yield (req, row_start, num_new, first_logical_position) for each request of a step, during the
    forward (before the step's counts advance)."""
    start = 0
    for req, n in zip(batch.requests, batch.num_new_tokens):
        yield req, start, n, req.num_computed_tokens
        start += n


def all_rows_decode(batch) -> bool:
    """Every row of the step decodes: one query past its prompt (a captured decode graph's static batch has
    no requests and only decode rows). Selection methods choose on the device with fixed shapes then, which
    is what makes those steps replayable."""
    return (batch.view.is_pure_decode and not batch.finished_prompt
            and all(req.num_computed_tokens >= req.num_prompt_tokens for req in batch.requests))
