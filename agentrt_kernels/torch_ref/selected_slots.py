"""Reference attention over an explicit list of KV slots per request (token-granularity selection).

Request ``i`` attends to the flat physical slots ``slot_indices[slot_indptr[i]:slot_indptr[i] + n_i]``
(``n_i = slot_counts[i]``, by default ``slot_indptr[i + 1] - slot_indptr[i]``; later entries are padding)
(``slot = page * page_size + offset`` into ``k_cache.flatten(0, 1)``), listed in increasing logical order.
Its ``query_lens[i]`` queries are its last listed slots, so with ``causal`` query ``j`` sees the first
``n_i - query_len + j + 1`` listed slots (for one query per request: all of them). Math runs in fp32 and the
result is cast back to the query dtype.
"""

import torch

from agentrt_kernels.torch_ref.paged_attention import _attend


def selected_slots_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_indptr: torch.Tensor,
    slot_indices: torch.Tensor,
    scale: float,
    query_lens: list[int] | None = None,
    slot_counts: list[int] | None = None,
    causal: bool = True,
    return_scores: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """q [T, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D]; slot_indptr [B + 1], slot_indices [nnz].

    ``query_lens`` (host list) defaults to one query per request (T == B); ``slot_counts`` (host list, the
    per-request list lengths) is read from ``slot_indptr`` when not given. Returns out [T, Hq, D] and, with
    ``return_scores``, one fp32 probability tensor [Hq, query_len, n_i] per request over its listed slots.
    """
    num_requests = slot_indptr.shape[0] - 1
    if query_lens is None:
        query_lens = [1] * num_requests
    if slot_counts is None:
        bounds = slot_indptr.tolist()
        slot_counts = [b - a for a, b in zip(bounds, bounds[1:])]
    assert len(query_lens) == len(slot_counts) == num_requests and sum(query_lens) == q.shape[0]
    assert all(0 < n <= c for n, c in zip(query_lens, slot_counts)), "every query needs itself among its slots"
    k_flat = k_cache.flatten(0, 1)  # [num_slots, Hkv, D]
    v_flat = v_cache.flatten(0, 1)
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    if num_requests == 0:
        return out, [] if return_scores else None
    if max(query_lens) == 1 and not return_scores:
        _decode_batched(q, k_flat, v_flat, slot_indptr, slot_indices, slot_counts, scale, out)
        return out, None
    scores: list[torch.Tensor] | None = [] if return_scores else None
    start = 0
    for n, count, offset in zip(query_lens, slot_counts, slot_indptr[:-1].tolist()):
        idx = slot_indices[offset:offset + count].long()
        k, v = k_flat[idx][None], v_flat[idx][None]
        visible = None
        if causal and n > 1:
            limit = torch.arange(count - n + 1, count + 1, device=q.device)
            visible = (torch.arange(count, device=q.device)[None, :] < limit[:, None])[None]
        o, p = _attend(q[start:start + n][None], k, v, visible, scale)
        out[start:start + n] = o[0].to(q.dtype)
        if scores is not None:
            scores.append(p[0])
        start += n
    return out, scores


def _decode_batched(q, k_flat, v_flat, slot_indptr, slot_indices, slot_counts, scale, out) -> None:
    """One query per request: pad every request's slot list to the longest and mask the padding."""
    width = max(slot_counts)
    counts = torch.tensor(slot_counts, device=q.device)
    cols = torch.arange(width, device=q.device)
    valid = cols[None, :] < counts[:, None]  # [B, width]
    flat = (slot_indptr[:-1].long()[:, None] + cols[None, :]).clamp(max=max(slot_indices.shape[0] - 1, 0))
    idx = torch.where(valid, slot_indices.long()[flat], 0)
    o, _ = _attend(q[:, None], k_flat[idx], v_flat[idx], valid[:, None, :], scale)
    out.copy_(o[:, 0].to(q.dtype))
