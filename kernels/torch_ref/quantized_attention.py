"""Reference attention over codec-stored paged KV: pages are decoded a block at a time inside the loop
(online softmax), so the whole context never exists in full precision at once.

Request ``i`` owns query rows ``sum(query_lens[:i]) : +query_lens[i]`` and attends to ``kv_lens[i]`` slots:
the first ``quant_lens[i]`` decoded from its pages (``block_tables[i]``) by ``decode_k`` / ``decode_v``
(page ids [n] int64 -> [n * page_size, Hkv, D] fp32), the rest read in full precision from the ring
``window_k/v[window_ids[i]]`` ([num_windows, capacity, Hkv, D]) at ``slot % capacity``. Causality as in
``paged_attention``: query ``j`` sees slots ``< kv_len - query_len + j + 1``. Math in fp32.
"""

from collections.abc import Callable, Iterator

import torch

Decode = Callable[[torch.Tensor], torch.Tensor]


def _blocks(decode_k: Decode, decode_v: Decode, pages: torch.Tensor, page_size: int, quant_len: int,
            kv_len: int, window_k, window_v, window_id: int | None, pages_per_block: int) -> Iterator:
    """(first slot, k [m, Hkv, D], v [m, Hkv, D]) blocks covering slots 0..kv_len-1 in order."""
    num_pages = -(-quant_len // page_size)
    for p0 in range(0, num_pages, pages_per_block):
        ids = pages[p0:p0 + pages_per_block]
        first = p0 * page_size
        m = min(quant_len - first, ids.numel() * page_size)
        yield first, decode_k(ids)[:m], decode_v(ids)[:m]
    if kv_len > quant_len:
        cap = window_k.shape[1]
        ring = torch.arange(quant_len, kv_len, device=pages.device) % cap
        yield quant_len, window_k[window_id, ring].float(), window_v[window_id, ring].float()


def quantized_paged_attention(
    q: torch.Tensor,
    decode_k: Decode,
    decode_v: Decode,
    block_tables: torch.Tensor,
    page_size: int,
    kv_lens: list[int],
    quant_lens: list[int],
    query_lens: list[int],
    scale: float,
    window_k: torch.Tensor | None = None,
    window_v: torch.Tensor | None = None,
    window_ids: list[int] | None = None,
    causal: bool = True,
    return_scores: bool = False,
    pages_per_block: int = 64,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """q [T, Hq, D] -> out [T, Hq, D] (q's dtype) and, with ``return_scores``, per request fp32
    probabilities [Hq, query_len, kv_len]."""
    out = torch.empty_like(q)
    scores: list[torch.Tensor] | None = [] if return_scores else None
    hq = q.shape[1]
    start = 0
    for i, (n, kv_len, quant_len) in enumerate(zip(query_lens, kv_lens, quant_lens)):
        qi = q[start:start + n].float().transpose(0, 1)  # [Hq, n, D]
        limit = torch.arange(kv_len - n + 1, kv_len + 1, device=q.device) if causal else None
        m_i = torch.full((hq, n, 1), float("-inf"), device=q.device)
        l_i = torch.zeros((hq, n, 1), device=q.device)
        acc = torch.zeros((hq, n, q.shape[2]), device=q.device)
        logits_all = []
        wid = None if window_ids is None else window_ids[i]
        for first, k, v in _blocks(decode_k, decode_v, block_tables[i].long(), page_size, quant_len, kv_len,
                                   window_k, window_v, wid, pages_per_block):
            group = hq // k.shape[1]
            kf = k.repeat_interleave(group, 1).transpose(0, 1)  # [Hq, m, D]
            vf = v.repeat_interleave(group, 1).transpose(0, 1)
            logits = torch.matmul(qi, kf.transpose(1, 2)) * scale  # [Hq, n, m]
            if limit is not None:
                slots = torch.arange(first, first + k.shape[0], device=q.device)
                logits = logits.masked_fill(~(slots[None, :] < limit[:, None])[None], float("-inf"))
            if scores is not None:
                logits_all.append(logits)
            m_new = torch.maximum(m_i, logits.amax(-1, keepdim=True))
            safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m_i - safe)
            p = torch.exp(logits - safe)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vf)
            m_i = m_new
        out[start:start + n] = (acc / l_i.clamp_min(1e-30)).transpose(0, 1).to(q.dtype)
        if scores is not None:
            scores.append(torch.softmax(torch.cat(logits_all, -1), -1))
        start += n
    return out, scores
