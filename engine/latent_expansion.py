"""Prompt chunks of a latent (MLA) cache through expanded keys and values instead of the absorbed form.

A latent layer's attention is exact both ways (``engine/models/mla.py``): absorbed, the queries go through
``W_UK`` and attend over the ``kv_lora_rank + rope`` latent rows as one KV head, then the output through
``W_UV``; expanded, every cached row a chunk reads becomes per-head keys ``[W_UK c, k_pe]`` and values ``W_UV c``
and the plain queries ``[q_nope, q_pe]`` attend over them. Per (query, key) pair the absorbed form multiplies
``2 * kv_lora_rank + rope`` channels, the expanded one ``nope + rope + v`` plus the expansion itself
(``rows x kv_lora_rank x (nope + v)`` per head), so expanding pays for chunks long enough
(``crossover_query_len``); on a GPU, expanded rows through the paged prefill kernel measured 1.8-5x faster than
the absorbed kernel for 512-8K-token chunks over 4K-32K contexts (``benchmarks.mla_prefill``, which also times
this module's path; docs/benchmarks.md). Decode rows stay absorbed (one query cannot pay for a context's
expansion) and so does every step a method reads scores from, or a view that is not the plain paged view.

``EngineConfig.mla_prefill`` picks: ``absorbed`` (every step as before), ``expanded`` (every prompt chunk of two
or more tokens expanded), ``auto`` (on a GPU, for shapes flash attention runs (``fused_on_gpu``), chunks of at
least ``crossover_query_len`` tokens whose expanded context fits ``MAX_EXPANDED_BYTES``; on a CPU absorbed).
The expansion is transient: one layer's K / V of one request at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.contract.view import PagedView

MLA_PREFILL_MODES = ("auto", "absorbed", "expanded")
MAX_EXPANDED_BYTES = 1 << 30  # one request's expanded K and V of one layer, under ``auto``


@dataclass(slots=True)
class LatentExpansion:
    """What a latent layer hands the runner besides the absorbed query: the plain query parts (this rank's
    heads), the absorption weights and the softmax scale of the plain query."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], rotated
    w_uk: torch.Tensor  # [H, nope, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v, kv_lora_rank]
    softmax_scale: float

    def absorb(self, out: torch.Tensor) -> torch.Tensor:
        """An absorbed attention output [T, H, kv_lora_rank] -> [T, H, v] (through ``W_UV``), contiguous: the
        batched product writes each head's columns straight into the rows the output projection reads (no
        transposing copy after it)."""
        t, heads, v = out.shape[0], self.w_uv.shape[0], self.w_uv.shape[1]
        result = torch.empty(t, heads, v, dtype=out.dtype, device=out.device)
        torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2), out=result.transpose(0, 1))
        return result

    def crossover_query_len(self) -> int:
        """The chunk length from which expanding costs fewer multiplies than the absorbed form (per cached row:
        ``rank * (nope + v)`` to expand it, against ``C * (2 * rank + rope - (nope + rope + v))`` saved)."""
        nope, rope = self.q_nope.shape[-1], self.q_pe.shape[-1]
        v, rank = self.w_uv.shape[1], self.w_uv.shape[2]
        saved = 2 * rank + rope - (nope + rope + v)
        return max(2, -(-rank * (nope + v) // saved)) if saved > 0 else 1 << 30

    def fused_on_gpu(self) -> bool:
        """Whether a GPU runs this shape's expanded attention in flash attention (fp16 / bf16, one head size of at
        most 256 for queries, keys and values: GLM-4.7-Flash's 192 + 64 = 256). Other shapes may fall to SDPA's
        unfused path, which holds the [H, C, L] logits, so ``auto`` keeps them absorbed."""
        qk = self.q_nope.shape[-1] + self.q_pe.shape[-1]
        return self.q_nope.dtype in (torch.float16, torch.bfloat16) and qk == self.w_uv.shape[1] <= 256

    def expanded_bytes(self, kv_len: int) -> int:
        heads, nope, rope, v = self.q_nope.shape[1], self.q_nope.shape[2], self.q_pe.shape[2], self.w_uv.shape[1]
        return kv_len * heads * (nope + rope + v) * self.q_nope.element_size()

    def attend(self, rows: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Query rows ``first .. first + count`` (one request's chunk, the last ``count`` of its ``L`` cached
        latent rows ``rows`` [L, kv_lora_rank + rope]) over the expanded keys and values -> [count, H, v]."""
        # imported here: torch.nn.attention.bias imports torch._dynamo, a second at every engine import
        from torch.nn.attention.bias import causal_lower_right

        rank = self.w_uk.shape[2]
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("lr,hnr->hln", latent, self.w_uk)
        value = torch.einsum("lr,hvr->hlv", latent, self.w_uv)
        key = torch.cat([k_nope, k_pe[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
        query = torch.cat([self.q_nope[first:first + count], self.q_pe[first:first + count]], dim=-1)
        # query j sees keys < L - count + j + 1: the chunk's own tokens are the last of its rows; 4-d inputs and
        # the lower-right causal bias let a GPU take a fused kernel (flash / memory-efficient) instead of
        # materializing the [H, count, L] logits
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key[None], value[None],
                                             attn_mask=causal_lower_right(count, rows.shape[0]),
                                             scale=self.softmax_scale)
        return out[0].transpose(0, 1)


def latent_rows(cache_rows: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One request's first ``kv_len`` latent rows [kv_len, width] from its pages of a latent cache
    ``cache_rows`` [num_pages, page_size, 1, width] (``block_table``: its page ids, on the device)."""
    page_size = cache_rows.shape[1]
    pages = block_table[: -(-kv_len // page_size)].long()
    return cache_rows[pages].reshape(-1, cache_rows.shape[-1])[:kv_len]


def requests_to_expand(mode: str, expansion: LatentExpansion, query_lens: list[int], kv_lens: list[int],
                       on_gpu: bool) -> list[bool]:
    """Which requests of a plain step take the expanded form under ``mode`` (``EngineConfig.mla_prefill``)."""
    if mode == "absorbed" or (mode == "auto" and not on_gpu):
        return [False] * len(query_lens)
    if mode == "expanded":
        return [q > 1 for q in query_lens]
    if not expansion.fused_on_gpu():
        return [False] * len(query_lens)
    least = expansion.crossover_query_len()
    return [q >= least and expansion.expanded_bytes(n) <= MAX_EXPANDED_BYTES for q, n in zip(query_lens, kv_lens)]


def attend_split(q: torch.Tensor, view: PagedView, cache_rows: torch.Tensor, expand: list[bool],
                 expansion: LatentExpansion,
                 absorbed: Callable[[torch.Tensor, PagedView], torch.Tensor]) -> torch.Tensor:
    """A step's latent attention -> [T, H, v]: the requests marked in ``expand`` one by one in the expanded form,
    each run of the others in one absorbed call (``absorbed(q rows, their sub-view)`` -> [rows, H, rank])."""
    lens = view.query_lens_cpu
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    out = expansion.q_nope.new_empty(q.shape[0], expansion.q_nope.shape[1], expansion.w_uv.shape[1])
    i = 0
    while i < len(lens):
        j = i
        while j < len(lens) and expand[j] == expand[i]:
            j += 1
        if expand[i]:
            for r in range(i, j):
                rows = latent_rows(cache_rows, view.block_tables[r], view.kv_lens_cpu[r])
                out[starts[r]:starts[r + 1]] = expansion.attend(rows, starts[r], lens[r])
        else:
            rows = slice(starts[i], starts[j])
            out[rows] = expansion.absorb(absorbed(q[rows], view.rows(i, j, starts[i])))
        i = j
    return out
