"""The Triton MLA decode kernel over its launch configurations, beside flashinfer's MLA wrapper, at a latent
model's attention shape: what its default launch leaves on the table.

    python -m benchmarks.mla_decode_sweep --json mla_decode_sweep.json   # GPU: GLM-4.7-Flash (20 heads)
    python -m benchmarks.mla_decode_sweep --coded --json coded.json      # the same over E4M3 latent rows
    python -m benchmarks.mla_decode_sweep --tiny                         # anywhere (interpreter): a smoke run

Per case (batch, context): random bf16 latent rows (kv_lora_rank + rope = 576 channels, page size 16 as the
engine's default, pages scattered), one query per request. Timed as decode steps run, replayed from a CUDA graph:
the kernel's default launch (``mla_paged_decode`` with no overrides), then every configuration of the grid (head
tile, rows per tile, warps, stages) at the default split count, then the three fastest over split counts; each
output checked against the default's. flashinfer's ``BatchMLAPagedAttentionWrapper`` (planned once, its run timed)
where installed. Each time is reported with the latent bytes it reads over the copy rate measured in the run (the
kernel's roofline fraction; the queries and outputs are a few KB). ``--coded``: the rows as E4M3 codes with their
two scales (``kv_storage="fp8"``), the same sweep, beside the bf16 rows at their default launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agentrt_kernels.triton._common import next_pow2  # noqa: E402
from benchmarks.roofline import copy_bandwidth  # noqa: E402
from benchmarks.sweep_helpers import add_row, finish_rows, grid, max_rel, timed  # noqa: E402

PAGE = 16  # tokens a page (the engine's default; --page-size)
GRID = {"block_h": [16, 32, 64], "block_n": [16, 32, 64], "num_warps": [4, 8], "num_stages": [2, 3]}
SPLITS = [4, 8, 12, 16, 24, 32, 48, 64]
TOP_BY_SPLITS = 3
TINY_GRID = {"block_h": [16], "block_n": [16, 32], "num_warps": [4], "num_stages": [2]}


def make_case(batch: int, context: int, heads: int, rank: int, rope: int, device, seed: int = 0, page: int = PAGE):
    gen = torch.Generator().manual_seed(seed)
    pages_per = -(-context // page)
    num_pages = batch * pages_per
    latent = torch.randn(num_pages, page, 1, rank + rope, generator=gen).to(device, torch.bfloat16)
    tables = torch.randperm(num_pages, generator=gen).view(batch, pages_per).to(device, torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, rank + rope, generator=gen).to(device, torch.bfloat16)
    return q, latent, tables, lens


def flashinfer_mla(q, latent, tables, lens, rank: int, scale: float):
    """A run closure of flashinfer's MLA wrapper planned for this batch, or None without flashinfer."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, heads, _ = q.shape
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(256 * 2**20, dtype=torch.uint8, device=q.device), backend="auto")
    pages_per = tables.shape[1]
    indptr = torch.arange(0, (batch + 1) * pages_per, pages_per, dtype=torch.int32, device=q.device)
    qo = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    wrapper.plan(qo, indptr, tables.reshape(-1), lens, heads, rank, latent.shape[-1] - rank, latent.shape[1],
                 causal=False, sm_scale=scale, q_data_type=q.dtype, kv_data_type=latent.dtype)
    rows = latent[:, :, 0]
    q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, rows[..., :rank], rows[..., rank:])


def coded_case(latent: torch.Tensor, rank: int) -> tuple[torch.Tensor, dict]:
    """The rows as ``kv_storage="fp8"`` stores them on a latent model (E4M3 codes, a latent and a rotary scale per
    row): (codes, the decode kernel's ``row_scales`` keyword)."""
    from policies.fp8_kv import E4M3LatentRow

    fields = E4M3LatentRow(rank).encode(latent)
    return fields["codes"], {"row_scales": (fields["scale"], fields["rope_scale"])}


def run_case(batch: int, context: int, heads: int, rank: int, rope: int, space: dict, splits: list[int],
             device, on_gpu: bool, rate: float, coded: bool = False, page: int = PAGE) -> dict:
    from agentrt_kernels.triton.mla_decode import mla_paged_decode

    q, rows, tables, lens = make_case(batch, context, heads, rank, rope, device, page=page)
    scale = (rank + rope) ** -0.5
    latent, kw = coded_case(rows, rank) if coded else (rows, {})
    # the rows' bytes (codes and their two fp32 scales a row when coded)
    nbytes = batch * context * ((rank + rope) * latent.element_size() + (8 if coded else 0))

    def entry(ms: float) -> dict:
        return {"ms": ms, "fraction_of_copy": nbytes / (ms * 1e-3) / rate}

    def decode(**launch):
        return mla_paged_decode(q, latent, tables, lens, scale, rank, **kw, **launch)

    ref = decode()
    row = {"batch": batch, "context": context, "heads": heads, "coded": coded, "latent_bytes": nbytes,
           "default": entry(1e3 * timed(decode, on_gpu))}
    if coded:  # the same rows in bf16 at their default launch, for the ratio the codes buy
        row["bf16_default"] = {"ms": 1e3 * timed(lambda: mla_paged_decode(q, rows, tables, lens, scale, rank),
                                                 on_gpu)}
    configs = []
    for cfg in grid(space):
        # a head tile more than twice the heads' power of two is padding only; up to it, a wider tile may take
        # Hopper's wgmma (64 rows a warpgroup) where a narrower one takes mma.sync
        if cfg.get("block_h", 16) > 2 * max(16, next_pow2(heads)):
            continue
        try:
            out = decode(**cfg)
            ms = 1e3 * timed(lambda: decode(**cfg), on_gpu)
        except Exception as exc:  # a launch that does not fit (shared memory, registers): recorded, skipped
            configs.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        configs.append({**cfg, **entry(ms), "max_rel_vs_default": max_rel(out, ref)})
    row["configs"] = configs
    ok = sorted((c for c in configs if "ms" in c), key=lambda c: c["ms"])
    if ok:
        row["best"] = ok[0]
    # the fastest launches at the default split count, each over split counts: a launch that loses with the
    # default's splits may win with more or fewer (more programs a SM, or fewer rows a program)
    row["top_by_splits"] = []
    for place, best in enumerate(ok[:TOP_BY_SPLITS]):
        cfg = {k: best[k] for k in space}
        for s in splits:
            out = decode(num_splits=s, **cfg)
            ms = 1e3 * timed(lambda: decode(num_splits=s, **cfg), on_gpu)
            row["top_by_splits"].append({"rank": place, **cfg, "num_splits": s, **entry(ms),
                                         "max_rel_vs_default": max_rel(out, ref)})
    if row["top_by_splits"]:
        row["best_split"] = min(row["top_by_splits"], key=lambda c: c["ms"])
    fi = flashinfer_mla(q, latent, tables, lens, rank, scale) if on_gpu and not coded else None
    if fi is not None:
        row["flashinfer"] = {**entry(1e3 * timed(fi, on_gpu, graph=False)), "max_rel_vs_default": max_rel(fi(), ref)}
    return row


def launch_only(cases, heads: int, rank: int, rope: int, keywords: dict, launches: int, device,
                page: int = PAGE) -> list[dict]:
    """Each case's kernel launched ``launches`` times with ``keywords``, nothing timed: what a profiler attaches to
    (``--launch-only``)."""
    from agentrt_kernels.triton.mla_decode import mla_paged_decode

    rows = []
    for batch, context in cases:
        q, latent, tables, lens = make_case(batch, context, heads, rank, rope, device, page=page)
        for _ in range(launches):
            out = mla_paged_decode(q, latent, tables, lens, (rank + rope) ** -0.5, rank, **keywords)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"batch": batch, "context": context, "page": page, "keywords": keywords,
                     "finite": bool(torch.isfinite(out).all())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=20, help="query heads (GLM-4.7-Flash: 20; DeepSeek-V3: 128)")
    ap.add_argument("--cases", default="8@4096,32@4096,8@32768", help="BATCH@CONTEXT,...")
    ap.add_argument("--coded", action="store_true", help="E4M3 latent rows (kv_storage fp8) instead of bf16")
    ap.add_argument("--default-launch", action="store_true",
                    help="no launch grid: the default launch alone over --splits (e.g. over contexts, to separate a "
                         "launch's fixed cost from its cost a row)")
    ap.add_argument("--splits", help="split counts to time, comma-separated (default: 4-64)")
    ap.add_argument("--grid", help="the launch grid as JSON, e.g. '{\"block_h\": [32, 64], \"block_n\": [32, 64]}' "
                                   "(keys of GRID; default: GRID)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run through the interpreter)")
    ap.add_argument("--page-size", type=int, default=PAGE, help="tokens a page of the latent pool")
    ap.add_argument("--launch-only", metavar="JSON",
                    help="no timing: each case's kernel launched --launches times with these mla_paged_decode "
                         "keywords (e.g. '{\"tma\": true}'; '{}' the default), for a profiler such as Nsight Compute")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda" and not args.tiny
    rank, rope, heads = (32, 16, 4) if args.tiny else (512, 64, args.heads)
    cases = [(2, 40)] if args.tiny else [tuple(map(int, c.split("@"))) for c in args.cases.split(",")]
    if args.launch_only is not None:
        return launch_only(cases, heads, rank, rope, json.loads(args.launch_only), args.launches, device,
                           args.page_size)
    space, splits = (TINY_GRID, [1, 2]) if args.tiny else (GRID, SPLITS)
    if args.grid:
        space = json.loads(args.grid)
    if args.default_launch:
        space = {}
    if args.splits:
        splits = [int(s) for s in args.splits.split(",")]
    rate = copy_bandwidth(device) if on_gpu else float("nan")  # the smoke run has no roofline
    rows = []
    print(f"copy rate {rate / 1e9:.0f} GB/s" if on_gpu else "copy rate: none (CPU smoke run)")
    for batch, context in cases:
        row = run_case(batch, context, heads, rank, rope, space, splits, device, on_gpu, rate, args.coded,
                       args.page_size)
        row["copy_bytes_per_s"] = rate
        add_row(args.json, rows, row)
        best = row.get("best_split", {})
        fi = row.get("flashinfer", {})
        nan = float("nan")
        print(f"bs{batch} @ {context}: default {row['default']['ms']:.3f} ms "
              f"({row['default']['fraction_of_copy']:.2f} of copy); best {best.get('ms', nan):.3f} ms "
              f"({best.get('fraction_of_copy', nan):.2f}) "
              f"{({k: best[k] for k in (*space, 'num_splits')} if best else '')}; "
              f"flashinfer {fi.get('ms', nan):.3f} ms; bf16 rows {row.get('bf16_default', {}).get('ms', nan):.3f} ms",
              flush=True)
    finish_rows(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
