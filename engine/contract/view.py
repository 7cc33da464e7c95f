"""Attention views: what an attention backend reads for one layer of one step.

A view describes *which* KV a layer's queries attend to; the cache manager owns the storage it points into.
Queries of all requests are flattened into one [T, Hq, D] tensor; request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]`` and attends to the first ``kv_lens[i]`` physical slots named by
``block_tables[i]``. The new tokens are the last ``query_len`` of those slots, so causal masking is
"query j sees slots < kv_len - query_len + j + 1".
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedView:
    """Dense paged KV: every resident slot of each request.

    block_tables: [B, max_pages] int32 page ids (padding entries are 0 and never read).
    kv_lens: [B] int32 physical KV length per request, new tokens included.
    query_start_loc: [B + 1] int32 CSR offsets into the flattened queries.
    Host copies (``*_cpu`` lists) let the torch backend loop without device syncs.
    """

    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    page_size: int
    kv_lens_cpu: list[int]
    query_lens_cpu: list[int]
    causal: bool = True

    @property
    def num_requests(self) -> int:
        return len(self.kv_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class SelectedPagesView(PagedView):
    """Logical selection: attention reads only the listed pages (a subset of what is resident).

    ``block_tables``/``kv_lens`` here name the selected pages and the number of selected slots; the last
    page of each request is always included so the new tokens stay visible.
    """
