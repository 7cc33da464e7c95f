"""A random paged latent (MLA) cache and the PagedView over it, for the attention backends' latent tests: one KV
head of ``width`` channels per slot (the values are a slice of it), pages in random order."""

import torch

from engine.contract.view import PagedView


def latent_view(kv_lens, query_lens, *, page: int, width: int, heads: int, device, dtype=torch.float32,
                scale: float = 1.0, seed: int = 0):
    """(q [sum(query_lens), heads, width], latent [pages, page, 1, width], view) on ``device`` in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in kv_lens]
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(len(kv_lens), max(pages_per), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = torch.tensor(order[at:at + n])
        at += n
    latent = (torch.randn(num_pages, page, 1, width, generator=g) * scale).to(device, dtype)
    q = (torch.randn(sum(query_lens), heads, width, generator=g) * scale).to(device, dtype)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    view = PagedView(block_tables=table.to(device), kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
                     query_start_loc=starts.to(device), page_size=page, kv_lens_cpu=list(kv_lens),
                     query_lens_cpu=list(query_lens))
    return q, latent, view
