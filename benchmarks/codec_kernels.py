"""Coded-KV decode kernels against the dense bf16 kernel on the same shape, over launch configurations.

    python -m benchmarks.codec_kernels --json codec_kernels.json      # GPU: the engine's batches at 32K / 128K
    python -m benchmarks.codec_kernels --tiny                         # CPU smoke run (Triton interpreter)

For each (batch, context) and KV storage (fp8, KIVI-4, KIVI-2 as the engine configures them) one attention
layer of the Llama-3.1-8B shape (32 q / 8 kv heads, d128, page 32) is encoded by the codec's own ``encode``
from seeded normal KV, laid out in shuffled pages, and decoded by ``quantized_decode_attention``: first in its
default launch configuration, checked against the torch reference over the same pages
(``agentrt_kernels.torch_ref.quantized_attention``, on the first two requests), then over a grid of tile sizes, warps,
pipelining stages and split counts, each checked against the default's output. Every time is the median of
CUDA-graph replays (no launch overhead, as inside the engine's decode graphs). Beside each coded kernel the
dense bf16 kernel (``paged_decode_attention``) runs on the same shape, so a row says how the coded step
compares with the bytes it saves: ``bytes_ratio`` (coded bytes / bf16 bytes, codes + scales + window) against
``time_ratio`` (coded time / dense time) -- a kernel that is as bandwidth-bound as the dense one has
``time_ratio`` ~ ``bytes_ratio``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

TINY = "--tiny" in sys.argv
if TINY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.contract.codec import decode_pages  # noqa: E402
from engine.registry import create_kv_storage  # noqa: E402
from agentrt_kernels.torch_ref.quantized_attention import quantized_paged_attention  # noqa: E402
from agentrt_kernels.triton import choose_num_splits, paged_decode_attention  # noqa: E402
from agentrt_kernels.triton.quant_decode import quantized_decode_attention  # noqa: E402

from benchmarks.sweep_helpers import grid, max_rel, save_rows, time_configs, timer  # noqa: E402

STORAGES = {"fp8": ("fp8", {}), "kivi4": ("kivi", {"bits": 4}), "kivi2": ("kivi", {"bits": 2})}
TINY_KIVI = {"group_size": 8, "residual": 8}  # the tiny pages hold 8 slots
# dense's batch in the engine runs at 32K and 128K (the matched-batch rows of docs/benchmarks.md)
CASES = [(27, 32768), (7, 131072)]
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "split_factor": (1, 2)}


class Shape:
    def __init__(self, tiny: bool):
        if tiny:
            self.hq, self.hkv, self.d, self.page, self.dtype = 4, 2, 64, 8, torch.float32
        else:
            self.hq, self.hkv, self.d, self.page, self.dtype = 32, 8, 128, 32, torch.bfloat16


def encode_pages(tc, num_pages: int, shape: Shape, gen: torch.Generator, device: str, chunk_pages: int = 2048):
    """Seeded normal KV [num_pages * page, Hkv, D] through the codec's ``encode``, page-shaped, in chunks."""
    specs = tc.fields(shape.d)
    parts: dict[str, list[torch.Tensor]] = {}
    for p0 in range(0, num_pages, chunk_pages):
        n = min(chunk_pages, num_pages - p0) * shape.page
        x = torch.randn(n, shape.hkv, shape.d, generator=gen, device=device).to(shape.dtype)
        for name, t in tc.encode(x).items():
            rows = shape.page // tc.token_group if specs[name].per_group else shape.page
            parts.setdefault(name, []).append(t.reshape(-1, rows, *t.shape[1:]))
    return {name: torch.cat(ts).contiguous() for name, ts in parts.items()}


def nbytes(fields: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in fields.values())


def run_case(batch: int, ctx: int, storage: str, shape: Shape, space: dict, gen, device: str, tiny: bool) -> dict:
    name, cfg = STORAGES[storage]
    codec = create_kv_storage(name, {**cfg, **TINY_KIVI} if tiny and name == "kivi" else cfg)
    pages_per = math.ceil(ctx / shape.page)
    num_pages = batch * pages_per + 1
    kf = encode_pages(codec.key, num_pages, shape, gen, device)
    vf = encode_pages(codec.value, num_pages, shape, gen, device)
    perm = torch.randperm(num_pages - 1, generator=gen, device=device)[: batch * pages_per] + 1
    bt = perm.view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    quant_len = codec.quant_len(ctx) if codec.has_window else ctx
    quant = torch.full((batch,), quant_len, dtype=torch.int32, device=device)
    window = (None, None, None)
    coded_bytes = (nbytes(kf) + nbytes(vf)) * (batch * pages_per) / num_pages
    if codec.has_window:
        cap = codec.window_capacity
        wk, wv = (torch.randn(batch, cap, shape.hkv, shape.d, generator=gen, device=device).to(shape.dtype)
                  for _ in range(2))
        window = (wk, wv, torch.arange(batch, dtype=torch.int32, device=device))
        coded_bytes += 2 * batch * (ctx - quant_len) * shape.hkv * shape.d * shape.dtype.itemsize
    q = torch.randn(batch, shape.hq, shape.d, generator=gen, device=device).to(shape.dtype)
    scale = shape.d**-0.5
    tables = codec.kernel_tables(shape.d, q.device)

    def run(**kw):
        return quantized_decode_attention(q, codec.kernel_format, kf, vf, bt, lens, quant, *window, scale,
                                          tables=tables, **kw)

    base = run()
    two = min(2, batch)
    ref, _ = quantized_paged_attention(
        q[:two].float(), lambda p: decode_pages(codec.key, kf, p, shape.d),
        lambda p: decode_pages(codec.value, vf, p, shape.d), bt[:two], shape.page, [ctx] * two, [quant_len] * two,
        [1] * two, scale, window_k=None if window[0] is None else window[0].float(),
        window_v=None if window[1] is None else window[1].float(),
        window_ids=None if window[2] is None else list(range(two)), pages_per_block=64)
    measure = timer(tiny)
    t_default = measure(run)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    default_splits = choose_num_splits(batch, shape.hkv, pages_per * shape.page, sms)
    launches = [{"block_n": c["block_n"], "num_warps": c["num_warps"], "num_stages": c["num_stages"],
                 "num_splits": min(64, default_splits * c["split_factor"])} for c in grid(space)]
    configs = time_configs(run, launches, measure, coded_bytes, base, max_rel)
    # the dense bf16 kernel on the same shape, same page size
    k, v = (torch.randn(num_pages, shape.page, shape.hkv, shape.d, generator=gen, device=device).to(shape.dtype)
            for _ in range(2))
    dense_bytes = 2 * batch * ctx * shape.hkv * shape.d * shape.dtype.itemsize
    t_dense = measure(lambda: paged_decode_attention(q, k, v, bt, lens, scale))
    if device == "cuda":
        torch.cuda.empty_cache()
    timed = [c for c in configs if "ms" in c]
    best = min(timed, key=lambda c: c["ms"]) if timed else None
    return {"storage": storage, "batch": batch, "context": ctx, "coded_bytes": coded_bytes,
            "bytes_ratio": coded_bytes / dense_bytes, "dense_ms": t_dense * 1e3,
            "dense_tb_s": dense_bytes / t_dense / 1e12, "default_ms": t_default * 1e3,
            "default_tb_s": coded_bytes / t_default / 1e12, "default_time_ratio": t_default / t_dense,
            "rel_err_vs_ref": max_rel(base[:two], ref), "default_splits": default_splits, "best": best,
            "best_time_ratio": best["ms"] / 1e3 / t_dense if best else None, "configs": configs}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, the interpreter, two configs")
    ap.add_argument("--storages", default="fp8,kivi4,kivi2")
    ap.add_argument("--cases", default=None, help="BATCHxCONTEXT,... (default: the engine's batches at 32K/128K)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = Shape(args.tiny)
    if args.cases:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    else:
        cases = [(3, 80)] if args.tiny else CASES
    space = {"block_n": (16,), "num_warps": (4,), "num_stages": (1,), "split_factor": (1, 2)} if args.tiny else SWEEP
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch, ctx in cases:
        for storage in args.storages.split(","):
            row = run_case(batch, ctx, storage, shape, space, gen, device, args.tiny)
            print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
            rows.append(row)
            save_rows(args.json, rows)
    print(f"\n{'storage':<8} {'batch':>5} {'context':>7} {'bytes':>6} {'dense ms':>9} {'coded ms':>9} "
          f"{'time':>6} {'best ms':>8} {'best':>6}  best config")
    for r in rows:
        b = r["best"] or {}
        cfg = {k: b[k] for k in ("block_n", "num_warps", "num_stages", "num_splits") if k in b}
        print(f"{r['storage']:<8} {r['batch']:>5} {r['context']:>7} {r['bytes_ratio']:>6.3f} {r['dense_ms']:>9.3f} "
              f"{r['default_ms']:>9.3f} {r['default_time_ratio']:>6.2f} {b.get('ms', float('nan')):>8.3f} "
              f"{r['best_time_ratio'] or float('nan'):>6.2f}  {cfg}")
    return rows


if __name__ == "__main__":
    main()
