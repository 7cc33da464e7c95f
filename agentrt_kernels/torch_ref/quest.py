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


def quest_decode_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k_cache: torch.Tensor,
                        block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                        aggregate: str = "max") -> torch.Tensor:
    """One decode query per row ``q`` [B, Hq, D] whose key was just written at slot ``kv_lens - 1``: widens
    that slot's page bounds in ``kmin``/``kmax`` [num_pages, Hkv, D] in place from ``k_cache`` [num_pages,
    page_size, Hkv, D] (a page's first slot resets them) and returns [B, W] fp32 scores of every column of
    ``block_tables`` [B, W] before the row's last page (the rest -inf), aggregated over all query heads."""
    lens = kv_lens.long()
    last = (lens - 1) // page_size  # [B] logical index of each row's last page
    page = block_tables.gather(1, last[:, None]).squeeze(1).long()
    offset = lens - 1 - last * page_size
    k_new = k_cache[page, offset]  # [B, Hkv, D] the key this step wrote
    fresh = (offset == 0)[:, None, None]  # a page's first slot resets its bounds
    kmin[page] = torch.where(fresh, k_new, torch.minimum(kmin[page], k_new))
    kmax[page] = torch.where(fresh, k_new, torch.maximum(kmax[page], k_new))
    idx = block_tables.long()
    scores = quest_page_scores(q, kmin[idx], kmax[idx], aggregate)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    return scores.masked_fill(cols[None, :] >= last[:, None], float("-inf"))  # candidates: before the last


def quest_decode_table(top_values: torch.Tensor, top_indices: torch.Tensor, block_tables: torch.Tensor,
                       kv_lens: torch.Tensor, page_size: int, token_budget: int, max_kept: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """From a row's top-k page scores (``top_values``/``top_indices`` [B, k], k >= 0) over the columns of
    ``block_tables`` [B, W]: the selected table [B, k + 1] (kept pages in column order, then the last page,
    then 0) and its lengths [B] in ``kv_lens``' dtype. A row keeps ``last`` pages when it has at most
    ``token_budget`` slots, else at most ``max_kept``; -inf scores are never kept."""
    bt, width, k = block_tables, block_tables.shape[1], top_indices.shape[1]
    lens = kv_lens.long()
    last = (lens - 1) // page_size
    per_row = torch.where(lens <= token_budget, last, torch.clamp(last, max=max_kept))  # pages kept
    if k > 0:
        kept = (torch.arange(k, device=bt.device)[None, :] < per_row[:, None]) & (top_values > float("-inf"))
        picked = torch.where(kept, top_indices, width + top_indices).sort(dim=1).values  # kept ones first
        count = kept.sum(dim=1)
    else:
        picked = torch.zeros(bt.shape[0], 0, dtype=torch.long, device=bt.device)
        count = torch.zeros_like(last)
    chosen = torch.cat([picked, torch.zeros_like(last)[:, None]], dim=1)
    chosen = torch.where(chosen >= width, 0, chosen)
    chosen.scatter_(1, count[:, None], last[:, None])  # the last page right after the kept ones
    new_lens = (count * page_size + lens - last * page_size).to(kv_lens.dtype)
    return bt.gather(1, chosen).to(bt.dtype), new_lens
