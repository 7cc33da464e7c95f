"""Reference Quest page metadata and page scoring (Tang et al. 2024, "Quest: Query-Aware Sparsity").

A page's metadata is the elementwise min and max of its keys, per KV head. For a query ``q`` of one head the
page's score ``sum_d max(q_d * min_d, q_d * max_d)`` is an upper bound on ``q . k`` for every key ``k`` of the
page. Math runs in fp32.
"""

import torch

AGGREGATES = ("max", "sum")


def page_key_bounds(
    k_cache: torch.Tensor, page_ids: torch.Tensor, valid_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_cache [num_pages, page_size, Hkv, D]; page_ids [n] int; valid_lens [n] int in [1, page_size]: how
    many leading slots of each page hold keys. Returns (kmin, kmax), each [n, Hkv, D] in the cache dtype."""
    keys = k_cache[page_ids.long()]  # [n, page_size, Hkv, D]
    offsets = torch.arange(keys.shape[1], device=keys.device)
    invalid = (offsets[None, :] >= valid_lens.to(keys.device)[:, None])[:, :, None, None]
    kmin = keys.masked_fill(invalid, float("inf")).amin(dim=1)
    kmax = keys.masked_fill(invalid, float("-inf")).amax(dim=1)
    return kmin, kmax


def quest_page_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, aggregate: str = "max"
) -> torch.Tensor:
    """q [B, Hq, D]; kmin/kmax [B, P, Hkv, D] (Hq a multiple of Hkv; query head ``h`` reads KV head
    ``h // (Hq // Hkv)``). Returns [B, P] fp32: the per-query-head upper bound ``sum_d max(q_d min_d,
    q_d max_d)`` aggregated over all query heads by ``aggregate`` ("max" or "sum")."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    group = q.shape[1] // kmin.shape[2]
    qf = q.float()[:, None]  # [B, 1, Hq, D]
    lo = kmin.float().repeat_interleave(group, dim=2)  # [B, P, Hq, D]
    hi = kmax.float().repeat_interleave(group, dim=2)
    per_head = torch.maximum(qf * lo, qf * hi).sum(dim=-1)  # [B, P, Hq]
    return per_head.amax(dim=-1) if aggregate == "max" else per_head.sum(dim=-1)
