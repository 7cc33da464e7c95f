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
least ``crossover_query_len`` tokens; on a CPU absorbed). The expansion is transient and bounded: a request's
context is expanded a block of rows at a time (at most ``MAX_EXPANDED_BYTES`` of K and V), each block attended
with its log-sum-exp, the blocks' outputs merged by it; the rows before the chunk need no mask, the chunk's own
rows a plain causal one, so flash attention runs every block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt_kernels import ops

from engine.contract.view import PagedView

MLA_PREFILL_MODES = ("auto", "absorbed", "expanded")
MAX_EXPANDED_BYTES = 1 << 30  # the expanded K and V of one block of one request's rows in one layer


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
        """An absorbed attention output [T, H, kv_lora_rank] -> [T, H, v] (through ``W_UV``), contiguous: each
        head's columns land straight in the rows the output projection reads (no transposing copy after it)."""
        return ops.head_matmul(out if out.stride(-1) == 1 else out.contiguous(), self.w_uv.transpose(1, 2))

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

    def bytes_per_row(self) -> int:
        """Bytes of one cached row's expanded key and value (this rank's heads)."""
        heads, nope, rope, v = self.q_nope.shape[1], self.q_nope.shape[2], self.q_pe.shape[2], self.w_uv.shape[1]
        return heads * (nope + rope + v) * self.q_nope.element_size()

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [n, kv_lora_rank + rope] -> per-head keys [1, H, n, nope + rope] and values [1, H, n, v]."""
        rank = self.w_uk.shape[2]
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("lr,hnr->hln", latent, self.w_uk)
        value = torch.einsum("lr,hvr->hlv", latent, self.w_uv)
        key = torch.cat([k_nope, k_pe[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
        return key[None], value[None]

    def attend(self, rows: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Query rows ``first .. first + count`` (one request's chunk, the last ``count`` of its ``L`` cached
        latent rows ``rows`` [L, kv_lora_rank + rope]) over the expanded keys and values -> [count, H, v]: the
        rows before the chunk in blocks of at most ``MAX_EXPANDED_BYTES``, all visible to every query, then the
        chunk's own rows, query j seeing the first j + 1; merged by their log-sum-exps."""
        query = torch.cat([self.q_nope[first:first + count], self.q_pe[first:first + count]], dim=-1)
        query = query.transpose(0, 1)[None]  # [1, H, count, nope + rope]
        before = rows.shape[0] - count
        block = max(1, MAX_EXPANDED_BYTES // self.bytes_per_row())
        parts = [_attention_with_lse(query, *self.expand(rows[start:min(start + block, before)]), False,
                                     self.softmax_scale) for start in range(0, before, block)]
        parts.append(_attention_with_lse(query, *self.expand(rows[before:]), True, self.softmax_scale))
        if len(parts) == 1:
            out = parts[0][0]
        else:
            lse = torch.stack([p[1] for p in parts])  # [blocks, 1, H, count], fp32
            weights = torch.softmax(lse, dim=0)[..., None]
            out = sum(w * p[0].float() for w, p in zip(weights, parts)).to(query.dtype)
        return out[0].transpose(0, 1)


def _attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention [1, H, C, v] of ``query`` [1, H, C, d] over ``key`` / ``value`` [1, H, n, .] and each query's
    log-sum-exp of its scaled logits [1, H, C] (fp32); ``causal``: query j sees keys <= j (C == n). Flash
    attention where it runs (the same head size for keys and values; on a GPU fp16 / bf16), else written out."""
    same_size = key.shape[-1] == value.shape[-1]
    if query.is_cuda and same_size and query.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                      scale=scale)[:2]
        return out, lse
    if not query.is_cuda and same_size:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                              scale=scale)[:2]
        return out, lse
    logits = torch.einsum("bhcd,bhnd->bhcn", query.float(), key.float()) * scale
    if causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("bhcn,bhnv->bhcv", torch.exp(logits - lse[..., None]), value.float())
    return out.to(query.dtype), lse


def latent_rows(cache_rows: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One request's first ``kv_len`` latent rows [kv_len, width] from its pages of a latent cache
    ``cache_rows`` [num_pages, page_size, 1, width] (``block_table``: its page ids, on the device)."""
    page_size = cache_rows.shape[1]
    pages = block_table[: -(-kv_len // page_size)].long()
    return cache_rows[pages].reshape(-1, cache_rows.shape[-1])[:kv_len]


def requests_to_expand(mode: str, expansion: LatentExpansion, query_lens: list[int], on_gpu: bool) -> list[bool]:
    """Which requests of a plain step take the expanded form under ``mode`` (``EngineConfig.mla_prefill``)."""
    if mode == "absorbed" or (mode == "auto" and not on_gpu):
        return [False] * len(query_lens)
    if mode == "expanded":
        return [q > 1 for q in query_lens]
    if not expansion.fused_on_gpu():
        return [False] * len(query_lens)
    least = expansion.crossover_query_len()
    return [q >= least for q in query_lens]


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
