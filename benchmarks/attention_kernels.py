"""GPU micro-benchmark: paged decode / prefill attention, Triton vs flashinfer vs the copy roofline, one run.

    python benchmarks/attention_kernels.py [--quick] [--json out.json]
    python benchmarks/attention_kernels.py --sweep --json sweep.json   # launch configurations of our kernels
    python benchmarks/attention_kernels.py --splits --json splits.json # decode split counts beside flashinfer

Measures in the same process: device-to-device copy bandwidth (bytes read + written), the bf16 matmul rate,
Triton paged decode (ours) and flashinfer's BatchDecodeWithPagedKVCacheWrapper with and without tensor cores
on the BENCH-ANCHORS shapes (32 q / 8 kv heads, d128, page 16, bf16, shuffled pages), and causal prefill of
one long sequence (Triton paged prefill vs flashinfer paged prefill). Each kernel is checked against a
reference before it is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as a script (``python benchmarks/attention_kernels.py``): the repo's packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sweep_helpers import save_rows  # noqa: E402
from agentrt_kernels.triton import paged_decode_attention, paged_prefill_attention  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def bench(fn, reps: int = 50) -> float:
    """Median seconds per call (triton.testing.do_bench: warm-up, L2 flush, CUDA events)."""
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e-3


def bench_graph(fn, reps: int = 50) -> float:
    """Median seconds per call replayed from a CUDA graph: no launch overhead, as inside a decode graph (a
    10-30 us kernel launched from Python is otherwise timed at its launch cost)."""
    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median") * 1e-3


def copy_bandwidth() -> float:
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * x.numel() / t


def matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, dtype=DTYPE, device="cuda")
    b = torch.randn(n, n, dtype=DTYPE, device="cuda")
    t = bench(lambda: a @ b, reps=30)
    return 2 * n**3 / t


def make_paged(batch: int, ctx: int, gen: torch.Generator):
    pages_per = math.ceil(ctx / PAGE)
    num_pages = batch * pages_per + 1
    k = torch.randn(num_pages, PAGE, HKV, D, dtype=DTYPE, device="cuda", generator=gen)
    v = torch.randn(num_pages, PAGE, HKV, D, dtype=DTYPE, device="cuda", generator=gen)
    perm = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: batch * pages_per] + 1
    block_tables = perm.view(batch, pages_per).to(torch.int32)
    kv_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k, v, block_tables, kv_lens


def dense_reference_decode(q, k, v, block_tables, kv_lens, scale):
    outs = []
    for b in range(q.shape[0]):
        n = int(kv_lens[b])
        pages = block_tables[b, : math.ceil(n / PAGE)].long()
        kb = k[pages].flatten(0, 1)[:n].float().repeat_interleave(HQ // HKV, 1)
        vb = v[pages].flatten(0, 1)[:n].float().repeat_interleave(HQ // HKV, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kb) * scale, -1)
        outs.append(torch.einsum("hn,nhd->hd", p, vb))
    return torch.stack(outs).to(q.dtype)


def flashinfer_decode(k, v, block_tables, kv_lens, use_tensor_cores: bool):
    import flashinfer

    batch, pages_per = block_tables.shape
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * pages_per
    last = (kv_lens - 1) % PAGE + 1
    wrapper.plan(indptr, block_tables.flatten(), last, HQ, HKV, D, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)
    return lambda q: wrapper.run(q, (k, v))


def decode_case(batch: int, ctx: int, with_flashinfer: bool, gen) -> dict:
    k, v, bt, lens = make_paged(batch, ctx, gen)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
    scale = D**-0.5
    kv_bytes = 2 * batch * ctx * HKV * D * DTYPE.itemsize
    ref = dense_reference_decode(q[:2], k, v, bt[:2], lens[:2], scale)
    ours = paged_decode_attention(q, k, v, bt, lens, scale)
    err = ((ours[:2].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    row = {"kernel": "decode", "batch": batch, "context": ctx, "rel_err_vs_ref": err}
    t = bench(lambda: paged_decode_attention(q, k, v, bt, lens, scale))
    row.update(triton_ms=t * 1e3, triton_tb_s=kv_bytes / t / 1e12)
    if with_flashinfer:
        for tc in (False, True):
            run = flashinfer_decode(k, v, bt, lens, tc)
            fi_err = ((run(q).float() - ours.float()).abs().max() / ours.float().abs().max()).item()
            t = bench(lambda: run(q))
            key = "flashinfer_tc" if tc else "flashinfer"
            row.update({f"{key}_ms": t * 1e3, f"{key}_tb_s": kv_bytes / t / 1e12, f"{key}_rel_diff": fi_err})
    del k, v
    torch.cuda.empty_cache()
    return row


def prefill_case(ctx: int, with_flashinfer: bool, gen) -> dict:
    k, v, bt, lens = make_paged(1, ctx, gen)
    q = torch.randn(ctx, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
    qsl = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    flops = 4 * HQ * D * ctx * ctx / 2  # causal: half of QK^T and PV
    ours = paged_prefill_attention(q, k, v, bt, lens, qsl, scale, causal=True, max_query_len=ctx)
    t = bench(lambda: paged_prefill_attention(q, k, v, bt, lens, qsl, scale, causal=True, max_query_len=ctx), reps=20)
    row = {"kernel": "prefill", "batch": 1, "context": ctx, "triton_ms": t * 1e3, "triton_tflop_s": flops / t / 1e12}
    # spot-check the last 64 queries against a dense computation
    tail = 64
    kk = k[bt[0].long()].flatten(0, 1)[:ctx].float().repeat_interleave(HQ // HKV, 1)
    vv = v[bt[0].long()].flatten(0, 1)[:ctx].float().repeat_interleave(HQ // HKV, 1)
    logits = torch.einsum("qhd,khd->hqk", q[-tail:].float(), kk) * scale
    mask = torch.arange(ctx, device="cuda")[None, :] <= torch.arange(ctx - tail, ctx, device="cuda")[:, None]
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(logits.masked_fill(~mask, float("-inf")), -1), vv)
    row["rel_err_vs_ref"] = ((ours[-tail:].float() - ref).abs().max() / ref.abs().max()).item()
    if with_flashinfer:
        import flashinfer

        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        pages = bt.shape[1]
        w.plan(qsl, torch.tensor([0, pages], dtype=torch.int32, device="cuda"), bt.flatten(),
               (lens - 1) % PAGE + 1, HQ, HKV, D, PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
        fi = w.run(q, (k, v))
        row["flashinfer_rel_diff"] = ((fi.float() - ours.float()).abs().max() / ours.float().abs().max()).item()
        t = bench(lambda: w.run(q, (k, v)), reps=20)
        row.update(flashinfer_ms=t * 1e3, flashinfer_tflop_s=flops / t / 1e12)
    return row


DECODE_SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3), "split_factor": (1, 2)}
# a decode graph's grid: the splits of the longest context (131072 tokens), whatever the request's length
GRAPH_SPLITS, GRAPH_MIN_SPLIT = 64, (0, 128, 256, 512)
SPLIT_FACTORS = (0.5, 0.67, 0.75, 1.33, 1.5, 2.0)
PREFILL_SWEEP = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}


def _timed(run, base: torch.Tensor, kw: dict, timer, work: float, unit: str) -> dict:
    """One launch configuration ``kw`` of ``run``: its output against ``base``, then its time by ``timer``
    (``work`` bytes or FLOPs per call, reported as ``unit`` in tera-units per second); a configuration the
    compiler rejects (out of shared memory) is recorded, not fatal."""
    try:
        out = run(**kw)
    except Exception as exc:  # noqa: BLE001
        return {**kw, "error": type(exc).__name__}
    err = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
    t = timer(lambda: run(**kw))
    return {**kw, "ms": t * 1e3, unit: work / t / 1e12, "rel_diff": err}


def _fastest(timings: list[dict]) -> dict:
    return min((r for r in timings if "ms" in r), key=lambda r: r["ms"])


def _grid(space: dict) -> list[dict]:
    configs = [{}]
    for name, values in space.items():
        configs = [{**c, name: v} for c in configs for v in values]
    return configs


def lowrank_sweep(gen, batch: int = 8, ctx: int = 32768, rank: int = 64) -> dict:
    """Palu's fused decode kernel (fp16 latents of rank 64 + positions) over launch configurations, against
    the dense bf16 decode kernel on the same shape (replayed from CUDA graphs)."""
    from agentrt_kernels.triton.lowrank_decode import lowrank_decode_attention

    pages_per = math.ceil(ctx / PAGE)
    num_pages = batch * pages_per + 1
    lat = dict(device="cuda", dtype=torch.float16)
    k_fields = {"latent": torch.randn(num_pages, PAGE, HKV, rank, generator=gen, **lat),
                "pos": torch.randint(0, ctx, (num_pages, PAGE, HKV, 1), generator=gen, device="cuda",
                                     dtype=torch.int32)}
    v_fields = {"latent": torch.randn(num_pages, PAGE, HKV, rank, generator=gen, **lat)}
    basis = torch.linalg.qr(torch.randn(HKV, D, D, generator=gen, device="cuda"))[0][..., :rank].contiguous()
    angles = torch.arange(ctx, device="cuda")[:, None] * (1e4 ** (-torch.arange(0, D, 2, device="cuda") / D))[None]
    tables = {"k_basis": basis, "v_basis": basis.clone(), "k_bias": torch.zeros(HKV, D, device="cuda"),
              "v_bias": torch.zeros(HKV, D, device="cuda"), "cos": angles.cos().contiguous(),
              "sin": angles.sin().contiguous()}
    perm = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: batch * pages_per] + 1
    bt = perm.view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
    latent_bytes = batch * ctx * HKV * (2 * rank * 2 + 4)

    def run(**kw):
        return lowrank_decode_attention(q, k_fields, v_fields, bt, lens, D**-0.5, tables, **kw)

    base = run()
    timings = [_timed(run, base, kw, bench_graph, latent_bytes, "latent_tb_s")
               for kw in _grid({"block_n": (16, 32, 64), "num_warps": (4, 8)})]
    k, v, bt_d, lens_d = make_paged(batch, ctx, gen)
    t_dense = bench_graph(lambda: paged_decode_attention(q, k, v, bt_d, lens_d, D**-0.5))
    return {"kernel": "palu-decode-sweep", "batch": batch, "context": ctx, "rank": rank,
            "dense_bf16_ms": t_dense * 1e3, "best": _fastest(timings), "configs": timings}


def sweep(gen, json_path: str | None = None) -> list[dict]:
    """Time the Triton kernels over a grid of launch configurations (each checked against the default
    configuration's output first); one row per shape with every configuration and the fastest, written to
    ``json_path`` after each row."""
    from agentrt_kernels.triton import two_wave_splits

    rows = []
    for batch, ctx in [(8, 32768), (1, 4096), (1, 131072), (64, 4096)]:
        k, v, bt, lens = make_paged(batch, ctx, gen)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
        scale = D**-0.5
        kv_bytes = 2 * batch * ctx * HKV * D * DTYPE.itemsize

        def run(**kw):
            return paged_decode_attention(q, k, v, bt, lens, scale, **kw)

        base = run()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        default_splits = two_wave_splits(batch, HKV, bt.shape[1] * PAGE, sms)
        configs = [{**{n: c[n] for n in ("block_n", "num_warps", "num_stages")},
                    "num_splits": min(64, default_splits * c["split_factor"])} for c in _grid(DECODE_SWEEP)]
        # and the decode graph's grid (the longest context's splits), with a floor on each split's length
        configs += [{"num_splits": GRAPH_SPLITS, "min_split_tokens": m} for m in GRAPH_MIN_SPLIT]
        # split counts around the default at the default launch: whether the programs' last partial wave
        # over the SMs (B x Hkv x splits programs, a few per SM) costs what a wave-quantization model says
        around = {round(default_splits * f) for f in SPLIT_FACTORS} | {default_splits - 1, default_splits + 1}
        configs += [{"num_splits": s} for s in sorted({max(1, min(64, s)) for s in around} - {default_splits})]
        timings = [_timed(run, base, kw, bench_graph, kv_bytes, "tb_s") for kw in configs]
        t_default = bench_graph(run)
        best = _fastest(timings)
        rows.append({"kernel": "decode-sweep", "batch": batch, "context": ctx, "default_ms": t_default * 1e3,
                     "default_splits": default_splits, "best": best, "configs": timings})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
        save_rows(json_path, rows)
        del k, v
        torch.cuda.empty_cache()
    rows.append(lowrank_sweep(gen))
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
    save_rows(json_path, rows)
    for ctx in (8192, 32768):
        k, v, bt, lens = make_paged(1, ctx, gen)
        q = torch.randn(ctx, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
        qsl = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
        scale, flops = D**-0.5, 4 * HQ * D * ctx * ctx / 2

        def run(**kw):
            return paged_prefill_attention(q, k, v, bt, lens, qsl, scale, causal=True, max_query_len=ctx, **kw)

        base = run()
        timings = [_timed(run, base, kw, lambda fn: bench(fn, reps=20), flops, "tflop_s")
                   for kw in _grid(PREFILL_SWEEP)]
        t_default = bench(run, reps=20)
        best = _fastest(timings)
        rows.append({"kernel": "prefill-sweep", "context": ctx, "default_ms": t_default * 1e3,
                     "default_tflop_s": flops / t_default / 1e12, "best": best, "configs": timings})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
        save_rows(json_path, rows)
    return rows


SPLIT_SHAPES = [(8, 32768), (32, 8192), (1, 131072), (64, 4096), (1, 4096), (8, 4096)]
SPLIT_MULTIPLES = (1, 1.5, 2, 3, 4)


def split_sweep(gen, with_fi: bool, json_path: str | None = None) -> list[dict]:
    """Our decode kernel at its default launch over split counts (multiples of the default, and 16 / 32 / 64),
    with flashinfer (tensor cores on and off) on the same inputs, ours timed as eager launches (as flashinfer is)
    and as CUDA-graph replays: which split rule closes the gap to flashinfer on which shapes."""
    from agentrt_kernels.triton import two_wave_splits

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, ctx in SPLIT_SHAPES:
        k, v, bt, lens = make_paged(batch, ctx, gen)
        q = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda", generator=gen)
        scale, kv_bytes = D**-0.5, 2 * batch * ctx * HKV * D * DTYPE.itemsize
        default = two_wave_splits(batch, HKV, bt.shape[1] * PAGE, sms)
        base = paged_decode_attention(q, k, v, bt, lens, scale)
        row = {"kernel": "decode-splits", "batch": batch, "context": ctx, "default_splits": default,
               "programs_per_split": batch * HKV, "sms": sms, "ours": []}
        for splits in sorted({min(64, round(default * m)) for m in SPLIT_MULTIPLES} | {16, 32, 64}):
            def run(splits=splits):
                return paged_decode_attention(q, k, v, bt, lens, scale, num_splits=splits)

            err = ((run().float() - base.float()).abs().max() / base.float().abs().max()).item()
            t_eager, t_graph = bench(run), bench_graph(run)
            row["ours"].append({"splits": splits, "eager_ms": t_eager * 1e3, "graph_ms": t_graph * 1e3,
                                "graph_tb_s": kv_bytes / t_graph / 1e12, "rel_diff": err})
        if with_fi:
            for tc in (False, True):
                fi = flashinfer_decode(k, v, bt, lens, tc)
                key = "flashinfer_tc" if tc else "flashinfer"
                row[f"{key}_eager_ms"] = bench(lambda: fi(q)) * 1e3  # its wrapper is not planned for graphs
        best = min(row["ours"], key=lambda r: r["graph_ms"])
        row["best_splits"] = best["splits"]
        for splits in sorted({best["splits"], two_wave_splits(batch, HKV, bt.shape[1] * PAGE, sms)}):
            def fused(splits=splits):  # the partials merged by the last split: one launch instead of two
                return paged_decode_attention(q, k, v, bt, lens, scale, num_splits=splits, fused_combine=True)

            err = ((fused().float() - base.float()).abs().max() / base.float().abs().max()).item()
            row.setdefault("fused_combine", []).append({"splits": splits, "eager_ms": bench(fused) * 1e3,
                                                        "graph_ms": bench_graph(fused) * 1e3, "rel_diff": err})
        print(json.dumps({k: v for k, v in row.items() if k != "ours"} | {"best": best}), flush=True)
        rows.append(row)
        save_rows(json_path, rows)
        del k, v
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time the Triton kernels over launch configurations")
    ap.add_argument("--splits", action="store_true", help="decode split counts beside flashinfer")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.splits:
        split_sweep(torch.Generator(device="cuda").manual_seed(0), not args.no_flashinfer, args.json)
        return
    if args.sweep:
        sweep(torch.Generator(device="cuda").manual_seed(0), args.json)
        return
    with_fi = not args.no_flashinfer
    if with_fi:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"flashinfer unavailable: {exc}")
            with_fi = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_tb_s": copy_bandwidth() / 1e12, "bf16_matmul_tflop_s": matmul_rate() / 1e12, "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    shapes = [(8, 32768)] if args.quick else [(8, 32768), (1, 131072), (64, 4096), (32, 8192), (1, 4096)]
    for batch, ctx in shapes:
        row = decode_case(batch, ctx, with_fi, gen)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    for ctx in ([8192] if args.quick else [8192, 32768]):
        row = prefill_case(ctx, with_fi, gen)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    print(f"\ncopy {result['copy_tb_s']:.2f} TB/s, bf16 matmul {result['bf16_matmul_tflop_s']:.0f} TFLOP/s")
    for r in result["rows"]:
        if r["kernel"] == "decode":
            fi = f"  flashinfer {r.get('flashinfer_tb_s', 0):.2f}  flashinfer-tc {r.get('flashinfer_tc_tb_s', 0):.2f}"
            print(f"decode bs{r['batch']:<3} ctx {r['context']:>6}: triton {r['triton_ms']:.3f} ms "
                  f"{r['triton_tb_s']:.2f} TB/s{fi}  (rel err {r['rel_err_vs_ref']:.1e})")
        else:
            print(f"prefill ctx {r['context']:>6}: triton {r['triton_tflop_s']:.0f} TFLOP/s  "
                  f"flashinfer {r.get('flashinfer_tflop_s', 0):.0f} TFLOP/s  (rel err {r['rel_err_vs_ref']:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
