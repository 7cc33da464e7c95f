"""Reference decode attention logits: ``q . k * scale`` of one query per request over its paged context.

q [B, Hq, D]; k_cache [num_pages, page_size, Hkv, D]; block_tables [B, max_pages]; ``kv_lens`` host ints.
Returns [B, Hq, width] fp32 with -inf past each request's length (``width`` defaults to max(kv_lens)).
"""

import torch


def paged_decode_logits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: list[int], scale: float, width: int | None = None) -> torch.Tensor:
    batch, num_q_heads, _ = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = max(kv_lens, default=0) if width is None else width
    out = torch.full((batch, num_q_heads, width), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(kv_lens):
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // page_size].long() * page_size + pos % page_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        out[b, :, :n] = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
    return out
