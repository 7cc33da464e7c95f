"""Shared pieces of the eviction methods: a request's slots and keys, the observation-window score of
SnapKV/PyramidKV, 1D pooling, a deterministic top-k, a per-request query stash, config checks, and a cache
manager that never lets the prefix cache swallow the observation window.

Conventions (those of the engine): query head ``j`` reads KV head ``j // group`` (``repeat_interleave``),
keys in the cache are post-RoPE, and the attention scale is ``head_dim ** -0.5`` (the runner's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.paged_cache import PagedCacheManager

if TYPE_CHECKING:
    from engine.contract.cache import CacheSpec
    from engine.page_pool import PagePool
    from engine.request import Request

POOLINGS = ("max", "avg")


# --- config checks --------------------------------------------------------------------------------
def check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


# --- a request's slots and keys -------------------------------------------------------------------
def request_slots(cache: PagedCacheManager, req: Request, n: int) -> torch.Tensor:
    """[n] int64 flat slot ids (``page * page_size + offset``) of the request's first ``n`` physical slots."""
    ps = cache.page_size
    device = cache.spec.device
    pages = torch.tensor(cache.table(req).pages[: -(-n // ps)], dtype=torch.int64, device=device)
    idx = torch.arange(n, device=device)
    return pages[idx // ps] * ps + idx % ps


def gather_keys(cache: PagedCacheManager, req: Request, layer: int, n: int) -> torch.Tensor:
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
    return probs.sum(dim=2).mean(dim=1)


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


# --- per-request query stash ----------------------------------------------------------------------
class QueryStash:
    """Query rows of one request, per layer, with their logical positions.

    ``push`` appends rows; with ``keep_last`` only the last that many rows are held (a rolling window)."""

    __slots__ = ("q", "pos")

    def __init__(self, num_layers: int):
        self.q: list[torch.Tensor | None] = [None] * num_layers
        self.pos: list[torch.Tensor | None] = [None] * num_layers

    def push(self, layer: int, rows: torch.Tensor, first_pos: int, keep_last: int | None = None) -> None:
        pos = torch.arange(first_pos, first_pos + rows.shape[0], device=rows.device)
        q, p = rows.detach().clone(), pos
        if self.q[layer] is not None:
            q, p = torch.cat([self.q[layer], q]), torch.cat([self.pos[layer], p])
        if keep_last is not None:
            q, p = q[-keep_last:], p[-keep_last:]
        self.q[layer], self.pos[layer] = q, p

    def rows_between(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stashed rows with logical position in [lo, hi) and those positions."""
        p = self.pos[layer]
        sel = (p >= lo) & (p < hi)
        return self.q[layer][sel], p[sel]

    def trim(self, keep_last: int) -> None:
        self.q = [None if q is None else q[-keep_last:] for q in self.q]
        self.pos = [None if p is None else p[-keep_last:] for p in self.pos]


def request_rows(batch):
    """Yield (req, row_start, num_new, first_logical_position) for each request of a step, during the
    forward (before the step's counts advance)."""
    start = 0
    for req, n in zip(batch.requests, batch.num_new_tokens):
        yield req, start, n, req.num_computed_tokens
        start += n


# --- prefix reuse that keeps the observation window computed ---------------------------------------
class WindowPreservingCache(PagedCacheManager):
    """A ``PagedCacheManager`` whose ``match_prefix`` reuses at most ``num_prompt_tokens - reserve`` tokens
    (rounded down to whole pages), so the queries of the prompt's last ``reserve`` tokens are always
    computed, even when the whole prompt sits in the prefix cache."""

    def __init__(self, spec: CacheSpec, pool: PagePool, enable_prefix_caching: bool, reserve: int):
        super().__init__(spec, pool, enable_prefix_caching=enable_prefix_caching)
        self.reserve = reserve

    def match_prefix(self, req: Request) -> int:
        cached = super().match_prefix(req)
        limit = max(0, req.num_prompt_tokens - self.reserve)
        if cached <= limit:
            return cached
        t = self.table(req)
        keep = limit // self.page_size
        for page in reversed(t.pages[keep:]):
            self.pool.decref(page)
        del t.pages[keep:]
        del t.keys[keep:]
        t.num_slots = keep * self.page_size
        return t.num_slots
