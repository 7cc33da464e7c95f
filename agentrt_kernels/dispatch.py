"""Device dispatch for kernels that methods call directly: the Triton kernel on a GPU, the torch reference
elsewhere (the same signature and result)."""

from __future__ import annotations

import torch


def paged_decode_logits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: torch.Tensor, kv_lens_cpu: list[int], scale: float, width: int) -> torch.Tensor:
    """[B, Hq, width] fp32 ``q . k * scale`` of one query per request over its paged context (-inf padding)."""
    if q.is_cuda:
        from agentrt_kernels.triton import paged_decode_logits as triton_logits

        return triton_logits(q, k_cache, block_tables, kv_lens, scale, width)
    from agentrt_kernels.torch_ref import paged_decode_logits as torch_logits

    return torch_logits(q, k_cache, block_tables, kv_lens_cpu, scale, width)


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor,
                      aggregate: str = "max") -> torch.Tensor:
    """[S, W] fp32 Quest upper bounds of the pages ``pages[s]`` (ids into the layer's ``kmin``/``kmax``
    [num_pages, Hkv, D]) for the decode queries ``q`` [S, Hq, D], aggregated over query heads."""
    if q.is_cuda:
        from agentrt_kernels.triton import quest_page_scores as triton_scores

        return triton_scores(q, kmin, kmax, pages, aggregate)
    from agentrt_kernels.torch_ref import quest_page_scores as torch_scores

    idx = pages.long()
    return torch_scores(q, kmin[idx], kmax[idx], aggregate)


def window_votes(q: torch.Tensor, k_cache: torch.Tensor, pages: torch.Tensor, n: int, scale: float,
                 use_triton: bool | None = None) -> torch.Tensor:
    """[Hkv, n] fp32: the attention probabilities the ``w`` query rows ``q`` [w, Hq, D] put on a request's ``n``
    paged slots (``pages`` [num_pages] int32 ids), summed over the rows and each KV head's query heads. The
    rows are the request's last ``w`` slots, causal among themselves (row j sees slots < n - w + j + 1). On a
    GPU (``use_triton``, default: on CUDA tensors): the key-split log-sum-exp and the received-attention kernels,
    no [w, n] probability matrix."""
    w = q.shape[0]
    block_tables = pages[None].to(torch.int32)
    if q.is_cuda if use_triton is None else use_triton:
        from agentrt_kernels.triton.received_attention import paged_lse, received_attention

        kv_lens = torch.tensor([n], dtype=torch.int32, device=q.device)
        qsl = torch.tensor([0, w], dtype=torch.int32, device=q.device)
        lse = paged_lse(q, k_cache, block_tables, kv_lens, qsl, scale, n, w)
        return received_attention(q, k_cache, block_tables, kv_lens, qsl, lse, scale, n, w)[0]
    from agentrt_kernels.torch_ref.received_attention import received_attention as torch_received

    return torch_received(q, k_cache, block_tables, [n], [w], scale)[0]
