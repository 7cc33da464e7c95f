"""Absorbed vs expanded MLA prefill: one layer's attention for a prompt chunk over a latent cache, both ways.

    python -m benchmarks.mla_prefill --json mla_prefill.json   # GPU: GLM-4.7-Flash's attention shape
    python -m benchmarks.mla_prefill --tiny                    # anywhere (interpreter on a CPU): a smoke run

A chunk of C new tokens (positions L - C .. L - 1) attends causally over the L latent rows its request holds
(its own included), H heads, bf16:

- **absorbed** (what the engine runs, ``engine/models/mla.py``): the queries' nope part through W_UK
  (``q_nope @ W_UK`` per head -> kv_lora_rank channels), attention over the latent rows (keys the whole
  ``kv_lora_rank + rope`` row, values its first ``kv_lora_rank`` channels) with the MLA prefill kernel
  (``agentrt_kernels/triton/mla_prefill.py``), then the output through W_UV;
- **expanded**: every cached row the chunk reads expanded per head (``K_nope = c @ W_UK^T``, ``V = c @ W_UV^T``,
  K = K_nope ++ k_rope), then the engine's paged prefill kernel for per-head K / V
  (``agentrt_kernels/triton/prefill_attention.py``) over the chunk's plain queries where K and V have one head
  size (GLM-4.7-Flash: 192 + 64 = 256 = v_head_dim), else torch's SDPA with a lower-right causal bias.

Each path's time includes its projections (absorption or expansion) and its attention; the two outputs are
checked against each other. A third column times the engine's own expanded path (``engine.latent_expansion``:
the context expanded a block of rows at a time, flash attention with its log-sum-exp per block, the blocks
merged). Times are medians of eager launches
(``triton.testing.do_bench``), as prefill runs. The output table gives both per (C, L) and their ratio;
docs/methods.md ("Latent ...") says which the engine takes and why.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from benchmarks.sweep_helpers import add_row, finish_rows, max_rel, timed  # noqa: E402

SHAPES = {  # name: (heads, kv_lora_rank, rope, nope, v)
    "glm-4.7-flash": (20, 512, 64, 192, 256),
    "deepseek-v3": (128, 512, 64, 128, 128),
}
TINY = (4, 32, 16, 24, 40)
PAGE = 16


def make_inputs(shape: tuple[int, ...], chunk: int, context: int, device, dtype=torch.bfloat16, seed: int = 0):
    """Random queries (nope, rope parts), latent rows [L, rank + rope], W_UK [H, nope, rank], W_UV [H, v, rank]."""
    heads, rank, rope, nope, v = shape
    gen = torch.Generator().manual_seed(seed)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device, dtype)

    return dict(q_nope=rand(chunk, heads, nope), q_pe=rand(chunk, heads, rope), rows=rand(context, rank + rope),
                w_uk=rand(heads, nope, rank, scale=rank**-0.5), w_uv=rand(heads, v, rank, scale=rank**-0.5),
                scale=(nope + rope) ** -0.5)


def _paged(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, ...] rows -> ([pages, PAGE, ...] zero-padded, block table [1, pages])."""
    pages = -(-rows.shape[0] // PAGE)
    padded = rows.new_zeros(pages * PAGE, *rows.shape[1:])
    padded[: rows.shape[0]] = rows
    table = torch.arange(pages, dtype=torch.int32, device=rows.device)[None]
    return padded.view(pages, PAGE, *rows.shape[1:]), table


def absorbed(q_nope, q_pe, rows, w_uk, w_uv, scale) -> torch.Tensor:
    """[C, H, v]: the engine's absorbed prefill."""
    from agentrt_kernels.triton.mla_prefill import mla_paged_prefill

    chunk, rank = q_nope.shape[0], w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [C, H, rank]
    query = torch.cat([q_latent, q_pe], dim=-1)
    latent, table = _paged(rows[:, None, :])
    dev = rows.device
    out = mla_paged_prefill(query, latent, table, torch.tensor([rows.shape[0]], dtype=torch.int32, device=dev),
                            torch.tensor([0, chunk], dtype=torch.int32, device=dev), scale, rank,
                            max_query_len=chunk)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def expanded(q_nope, q_pe, rows, w_uk, w_uv, scale) -> torch.Tensor:
    """[C, H, v]: every cached row expanded per head, then per-head attention."""
    chunk, heads, nope = q_nope.shape
    rank, v_dim = w_uk.shape[2], w_uv.shape[1]
    context, rope = rows.shape[0], q_pe.shape[-1]
    c, k_pe = rows[:, :rank], rows[:, rank:]
    k_nope = torch.einsum("lr,hnr->lhn", c, w_uk)  # [L, H, nope]
    values = torch.einsum("lr,hvr->lhv", c, w_uv)  # [L, H, v]
    keys = torch.cat([k_nope, k_pe[:, None, :].expand(context, heads, rope)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    if keys.shape[-1] == v_dim:
        from agentrt_kernels.triton.prefill_attention import paged_prefill_attention

        k_cache, table = _paged(keys)
        v_cache, _ = _paged(values)
        dev = rows.device
        return paged_prefill_attention(query, k_cache, v_cache, table,
                                       torch.tensor([context], dtype=torch.int32, device=dev),
                                       torch.tensor([0, chunk], dtype=torch.int32, device=dev), scale,
                                       max_query_len=chunk)
    from torch.nn.attention.bias import causal_lower_right

    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=causal_lower_right(chunk, context),
                                         scale=scale)
    return out[0].transpose(0, 1)


def engine_expanded(q_nope, q_pe, rows, w_uk, w_uv, scale) -> torch.Tensor:
    """[C, H, v]: what the engine runs for an expanded prompt chunk (``engine.latent_expansion``: blocks of rows
    expanded and attended with their log-sum-exps, then merged)."""
    from engine.latent_expansion import LatentExpansion

    return LatentExpansion(q_nope, q_pe, w_uk, w_uv, scale).attend(rows, 0, q_nope.shape[0])


def reference(q_nope, q_pe, rows, w_uk, w_uv, scale) -> torch.Tensor:
    """[C, H, v] in fp32, from the definition: per-head keys and values, causal softmax."""
    f = {name: x.float() for name, x in dict(q_nope=q_nope, q_pe=q_pe, rows=rows, w_uk=w_uk, w_uv=w_uv).items()}
    rank = f["w_uk"].shape[2]
    c, k_pe = f["rows"][:, :rank], f["rows"][:, rank:]
    logits = (torch.einsum("chn,lr,hnr->hcl", f["q_nope"], c, f["w_uk"])
              + torch.einsum("chp,lp->hcl", f["q_pe"], k_pe)) * scale
    chunk, context = q_nope.shape[0], rows.shape[0]
    visible = torch.arange(context)[None, :] <= (context - chunk + torch.arange(chunk))[:, None]
    probs = torch.softmax(logits.masked_fill(~visible.to(logits.device), float("-inf")), dim=-1)
    return torch.einsum("hcl,lr,hvr->chv", probs, c, f["w_uv"])


def run_case(shape, chunk: int, context: int, device, on_gpu: bool) -> dict:
    inputs = make_inputs(shape, chunk, context, device)
    a, e = absorbed(**inputs), expanded(**inputs)
    row = {"chunk": chunk, "context": context, "heads": shape[0], "agree_max_rel": max_rel(a, e)}
    row["absorbed_ms"] = 1e3 * timed(lambda: absorbed(**inputs), on_gpu, graph=False)
    row["expanded_ms"] = 1e3 * timed(lambda: expanded(**inputs), on_gpu, graph=False)
    row["expanded_over_absorbed"] = row["expanded_ms"] / row["absorbed_ms"]
    row["engine_expanded_ms"] = 1e3 * timed(lambda: engine_expanded(**inputs), on_gpu, graph=False)
    row["engine_agree_max_rel"] = max_rel(a, engine_expanded(**inputs))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="glm-4.7-flash", choices=sorted(SHAPES))
    ap.add_argument("--chunks", default="512,2048,8192")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run through the interpreter)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else SHAPES[args.shape]
    cases = [(8, 40), (40, 40)] if args.tiny else [
        (c, l) for l in map(int, args.contexts.split(",")) for c in map(int, args.chunks.split(",")) if c <= l]
    rows = []
    print(f"{'chunk':>6} {'context':>8} {'absorbed ms':>12} {'expanded ms':>12} {'exp/abs':>8} {'agree':>8} "
          f"{'engine exp ms':>14}")
    for chunk, context in cases:
        row = run_case(shape, chunk, context, device, on_gpu)
        add_row(args.json, rows, {"shape": "tiny" if args.tiny else args.shape, **row})
        print(f"{chunk:>6} {context:>8} {row['absorbed_ms']:>12.3f} {row['expanded_ms']:>12.3f} "
              f"{row['expanded_over_absorbed']:>8.2f} {row['agree_max_rel']:>8.1e} {row['engine_expanded_ms']:>14.3f}",
              flush=True)
    finish_rows(args.json, rows)


if __name__ == "__main__":
    main()
