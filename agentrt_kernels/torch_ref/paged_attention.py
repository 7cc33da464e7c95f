"""Reference paged attention in plain torch: the CPU backend and the oracle GPU kernels are tested against.

Queries of all requests are flattened: request ``i`` owns rows ``sum(query_lens[:i]) : +query_lens[i]`` and
attends to its first ``kv_lens[i]`` slots, read page by page through ``block_tables[i]``. Its queries are
its last ``query_lens[i]`` slots, so with ``causal`` query ``j`` sees slots ``< kv_len - query_len + j + 1``.
Math runs in fp32 and the result is cast back to the query dtype.
"""

import torch


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """cache [P, page_size, H, D], pages [n] -> [length, H, D]."""
    return cache[pages].flatten(0, 1)[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, n, Hq, D], k/v [B, L, Hkv, D], visible [B, n, L] bool -> out [B, n, Hq, D], probs [B, Hq, n, L]."""
    group = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)  # [B, Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    logits = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, vf).transpose(1, 2)
    return out, probs


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: list[int],
    query_lens: list[int],
    scale: float,
    causal: bool = True,
    return_scores: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """q [T, Hq, D]; k_cache [num_pages, page_size, Hkv, D], v_cache [num_pages, page_size, Hkv, Dv] (Dv may differ
    from D: a latent cache's values are a view of its keys' first Dv channels); block_tables [B, max_pages] int.

    Returns out [T, Hq, Dv] and, with ``return_scores``, one fp32 probability tensor [Hq, query_len, kv_len]
    per request.
    """
    page_size = k_cache.shape[1]
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    scores: list[torch.Tensor] | None = [] if return_scores else None
    if query_lens and max(query_lens) == 1 and not return_scores:
        _decode_batched(q, k_cache, v_cache, block_tables, kv_lens, scale, out)
        return out, None
    start = 0
    for i, (n, length) in enumerate(zip(query_lens, kv_lens)):
        pages = block_tables[i, : -(-length // page_size)].long()
        k = _gather(k_cache, pages, length)[None]
        v = _gather(v_cache, pages, length)[None]
        visible = None
        if causal and n > 1:
            limit = torch.arange(length - n + 1, length + 1, device=q.device)
            visible = (torch.arange(length, device=q.device)[None, :] < limit[:, None])[None]
        o, p = _attend(q[start:start + n][None], k, v, visible, scale)
        out[start:start + n] = o[0].to(q.dtype)
        if scores is not None:
            scores.append(p[0])
        start += n
    return out, scores


def _decode_batched(q, k_cache, v_cache, block_tables, kv_lens, scale, out) -> None:
    """One query per request: pad every request's KV to the longest and mask the padding."""
    page_size = k_cache.shape[1]
    max_len = max(kv_lens)
    num_pages = -(-max_len // page_size)
    pages = block_tables[:, :num_pages].long()
    k = k_cache[pages].flatten(1, 2)[:, :max_len]  # [B, max_len, Hkv, D]
    v = v_cache[pages].flatten(1, 2)[:, :max_len]
    lens = torch.tensor(kv_lens, device=q.device)
    visible = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, :]
    o, _ = _attend(q[:, None], k, v, visible, scale)
    out.copy_(o[:, 0].to(q.dtype))
