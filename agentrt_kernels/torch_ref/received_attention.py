"""Reference received attention: for each request and KV head, the attention probability every slot receives,
summed over the request's queries and the KV head's query heads (what H2O accumulates per step), or with
``reduce="max"`` their maximum (what KVzip's reconstruction probe keeps).

Same layout as ``paged_attention`` (flattened queries, paged KV, causal over each request's last
``query_len`` slots). Queries are taken ``chunk`` rows at a time, so no [Hq, query_len, kv_len] matrix of a
long prompt is ever held whole. Returns one fp32 [Hkv, kv_len] tensor per request.
"""

import torch

from agentrt_kernels.torch_ref.paged_attention import _gather


def received_attention(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: list[int],
                       query_lens: list[int], scale: float, causal: bool = True,
                       chunk: int = 256, reduce: str = "sum") -> list[torch.Tensor]:
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out, start = [], 0
    for i, (n, length) in enumerate(zip(query_lens, kv_lens)):
        pages = block_tables[i, : -(-length // page_size)].long()
        k = _gather(k_cache, pages, length).float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        received = torch.zeros(q.shape[1], length, dtype=torch.float32, device=q.device)
        for c0 in range(0, n, chunk):
            rows = q[start + c0: start + min(n, c0 + chunk)].float().transpose(0, 1)  # [Hq, c, D]
            logits = torch.matmul(rows, k.transpose(1, 2)) * scale  # [Hq, c, L]
            if causal:
                limit = torch.arange(length - n + c0 + 1, length - n + c0 + rows.shape[1] + 1, device=q.device)
                visible = torch.arange(length, device=q.device)[None, :] < limit[:, None]
                logits = logits.masked_fill(~visible[None], float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            if reduce == "sum":
                received += probs.sum(dim=1)
            else:
                torch.maximum(received, probs.amax(dim=1), out=received)
        per_head = received.view(num_kv_heads, group, length)
        out.append(per_head.sum(dim=1) if reduce == "sum" else per_head.amax(dim=1))
        start += n
    return out


def merge_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """[tiles, T, Hq] partial maxima and sums of ``exp2(logit - max)`` per key tile -> [T, Hq] log2-sum-exp of
    every row's logits (-inf where no tile saw a slot): what ``agentrt_kernels.triton.received_attention``
    computes in one launch."""
    top = m.amax(dim=0)
    safe = torch.where(torch.isfinite(top), top, 0.0)
    total = (l * torch.exp2(m - safe)).sum(dim=0)
    return torch.where(total > 0, safe + torch.log2(total), float("-inf"))
