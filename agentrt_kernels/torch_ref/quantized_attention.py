"""Reference attention over codec-stored paged KV: pages are decoded a block at a time inside the loop
(online softmax), so the whole context never exists in full precision at once.

Request ``i`` owns query rows ``sum(query_lens[:i]) : +query_lens[i]`` and attends to ``kv_lens[i]`` slots:
the first ``quant_lens[i]`` decoded from its pages (``block_tables[i]``) by ``decode_k`` / ``decode_v``
(page ids [n] int64 -> [n * page_size, Hkv, D] fp32), the rest read in full precision from the ring
``window_k/v[window_ids[i]]`` ([num_windows, capacity, Hkv, D]) at ``slot % capacity``. Causality as in
``paged_attention``: query ``j`` sees slots ``< kv_len - query_len + j + 1``. Math in fp32.

A block holds as many pages as fit ``block_bytes`` of fp32 keys, values and logits (a few hundred pages for a
decode or window row set on a GPU, so a 128K context is a dozen blocks rather than 2000 tiny ones), and each
KV head's query heads share one matmul with it (no per-query-head copies of the block).
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
    pages_per_block: int | None = None,
    block_bytes: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """q [T, Hq, D] -> out [T, Hq, D] (q's dtype) and, with ``return_scores``, per request fp32
    probabilities [Hq, query_len, kv_len]. ``pages_per_block`` fixes the block; else it follows from
    ``block_bytes`` (default: 512 MiB on a GPU, 32 MiB elsewhere)."""
    out = torch.empty_like(q)
    scores: list[torch.Tensor] | None = [] if return_scores else None
    hq, d = q.shape[1], q.shape[2]
    if block_bytes is None:
        block_bytes = (512 if q.is_cuda else 32) * 2**20
    start = 0
    for i, (n, kv_len, quant_len) in enumerate(zip(query_lens, kv_lens, quant_lens)):
        limit = torch.arange(kv_len - n + 1, kv_len + 1, device=q.device) if causal else None
        m_i = torch.full((hq, n, 1), float("-inf"), device=q.device)
        l_i = torch.zeros((hq, n, 1), device=q.device)
        acc = torch.zeros((hq, n, d), device=q.device)
        logits_all = []
        wid = None if window_ids is None else window_ids[i]
        per_block = pages_per_block or _pages_per_block(block_bytes, page_size, hq, n, d)
        qi = q[start:start + n].float().transpose(0, 1)  # [Hq, n, D]
        for first, k, v in _blocks(decode_k, decode_v, block_tables[i].long(), page_size, quant_len, kv_len,
                                   window_k, window_v, wid, per_block):
            hkv, m = k.shape[1], k.shape[0]
            group = hq // hkv
            qg = qi.reshape(hkv, group * n, d)  # query head j belongs to KV head j // group
            logits = torch.matmul(qg, k.permute(1, 2, 0)).view(hq, n, m) * scale  # [Hq, n, m]
            if limit is not None:
                slots = torch.arange(first, first + m, device=q.device)
                logits = logits.masked_fill(~(slots[None, :] < limit[:, None])[None], float("-inf"))
            if scores is not None:
                logits_all.append(logits)
            m_new = torch.maximum(m_i, logits.amax(-1, keepdim=True))
            safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m_i - safe)
            p = torch.exp(logits - safe)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            pv = torch.matmul(p.view(hkv, group * n, m), v.transpose(0, 1)).view(hq, n, d)
            acc = acc * alpha + pv
            m_i = m_new
        out[start:start + n] = (acc / l_i.clamp_min(1e-30)).transpose(0, 1).to(q.dtype)
        if scores is not None:
            scores.append(torch.softmax(torch.cat(logits_all, -1), -1))
        start += n
    return out, scores


def _pages_per_block(block_bytes: int, page_size: int, num_q_heads: int, num_rows: int, head_dim: int) -> int:
    """Pages whose fp32 keys and values (counted at Hq heads: an upper bound for GQA) plus logits and
    probabilities for ``num_rows`` query rows fit ``block_bytes``; at least one."""
    per_slot = 4 * (2 * num_q_heads * head_dim + 2 * num_q_heads * num_rows)
    return max(1, block_bytes // (per_slot * page_size))
