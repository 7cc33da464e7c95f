"""Sparse-method decode benchmark over long contexts filled with synthetic KV.

A 128K prefill per request would dominate the run, so each request's first ``context - window`` slots are
filled with random KV (seeded normal values) and only its last ``window`` prompt tokens are prefilled for
real; the method then runs its real selection / eviction code on that KV (SnapKV votes with the window's
queries at the end of the prompt, Quest builds its page bounds through ``kv_loaded``...). Requests are
admitted ``--admit-group`` at a time until the pool (keeping each request the pages it grows by before
the timing ends) or ``--max-batch`` is full, and aggregate decode throughput is
timed over steps where every admitted request decodes: a decode-only figure (admission, the prefills and
the methods' votes and compaction are untimed; ``run_phase_s`` says how long they took, and
``benchmarks.serving`` times them as a user pays them). Tokens are counted per request from its own output
counter; a decode window launched before the timing (``overlap_decode``, the GPU default) has finished by
the sync that opens it, so the tokens the first timed step takes from it are not counted. Each figure is the
median of ``--repeats`` timed windows, with min and max.

    python -m benchmarks.sparse_decode --shape llama-3.1-8b --context 131072 \\
        --methods 'dense;snapkv:{"budget":4096};quest:{"token_budget":4096};omnikv:{"token_budget":4096}'

A method spec may name a KV storage after ``+`` (``snapkv:{"budget":4096}+kivi:{"bits":4}``, ``dense+fp8``);
``--kv-storage NAME[:JSON]`` applies one to every spec that names none. ``--match-batch`` runs every other
spec a second time at the batch the dense spec reached (throughput at matched batch, besides at the largest
batch each one fits); ``--matched-only`` runs the others at that batch only.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.throughput import TimedTokens, aggregate_runs, with_spread, write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def parse_methods(spec: str) -> list[tuple[str, dict]]:
    out = []
    for item in filter(None, spec.split(";")):
        name, _, cfg = item.partition(":")
        out.append((name.strip(), json.loads(cfg) if cfg else {}))
    return out


def parse_specs(spec: str, default_storage: str | None) -> list[tuple[str, dict, str | None, dict]]:
    """``METHOD[:JSON][+STORAGE[:JSON]]`` items -> (method, config, storage, storage config)."""
    out = []
    for item in filter(None, spec.split(";")):
        method, _, storage = item.partition("+")
        storage = storage or default_storage
        ((name, cfg),) = parse_methods(method)
        ((sname, scfg),) = parse_methods(storage) if storage else ((None, {}),)
        out.append((name, cfg, sname, scfg))
    return out


def add_synthetic(engine: LLMEngine, context: int, window: int, max_tokens: int, rng: random.Random,
                  gen: torch.Generator) -> bool:
    """Queue one request whose first ``context - window`` slots hold random KV; False if the pool is full."""
    vocab = engine.model_config.vocab_size
    rid = engine.add_request([rng.randrange(vocab) for _ in range(context)],
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    req = engine._requests[rid]
    cache, n_fill = engine.cache, context - window
    if not cache.allocate(req, n_fill):
        engine.abort(rid)
        return False
    shape = (n_fill, cache.spec.num_kv_heads, cache.spec.head_dim)
    for layer in range(cache.spec.num_layers):
        k, v = (torch.randn(shape, generator=gen, device=engine.device).to(cache.spec.dtype) for _ in range(2))
        cache.write_prefix(req, layer, k, v)
    cache.commit(req, n_fill)
    req.num_computed_tokens = n_fill
    engine.method.kv_loaded(req, cache)
    return True


def has_room(engine: LLMEngine, args, admitted: int) -> bool:
    """Whether one more request's filled KV fits and leaves every request (it included) the pages to grow by
    the tokens still to come before the timing ends: one per later admission round plus the timed steps.
    Without that headroom a full pool preempts requests during the timed steps."""
    n = admitted + 1
    rounds_left = -(-(args.max_batch - admitted) // args.admit_group)
    grow = -(-(rounds_left * 2 + timed_tokens(args) + 8) // args.page_size) + 1
    fill = -(-args.context // args.page_size)
    return engine.pool.num_free >= fill + n * grow


def timed_tokens(args) -> int:
    """Tokens each request decodes from the end of admission to the end of the last timed window: every
    repetition with the window it starts by taking (overlap_decode), and the window launched after the last."""
    return args.repeats * (args.decode_steps + args.decode_window) + args.decode_window


def timed_decode(engine: LLMEngine, steps_wanted: int, sync) -> dict:
    """One timed window of at least ``steps_wanted`` decode steps in which every admitted request decodes."""
    reqs = list(engine._requests.values())
    if not reqs:
        raise RuntimeError("no admitted request to time")
    graphs = engine.runner.graphs
    replays_before = 0 if graphs is None else graphs.replays
    padded_before = 0 if graphs is None else graphs.padded_replays
    sync()
    timed = TimedTokens(engine, reqs)
    timed.start()
    t0, steps = time.perf_counter(), 0
    phases: dict[str, list[float]] = {"schedule": [], "prepare": [], "execute": [], "update": []}
    while steps < steps_wanted:
        engine.step()
        if not timed.took():
            continue  # it took the window launched before t0
        timing = engine.last_step
        k = timing.decode_steps if timing is not None else 0  # a window runs several; a launch alone none
        steps += k
        if k:
            for phase, values in phases.items():
                values.append(1e3 * getattr(timing, f"{phase}_s") / k)
    elapsed = time.perf_counter() - t0  # every counted token was read by the host: its device work is done
    sync()  # (the window launched by the last step is neither counted nor timed)
    tokens = timed.count()
    return {"decode_tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / steps, "timed_steps": steps,
            "timed_tokens": tokens, "in_flight_tokens_excluded": timed.excluded,
            # replays launched in the window: with overlap_decode, the window launched last is among them
            "graph_replayed_steps": 0 if graphs is None else graphs.replays - replays_before,
            "graph_padded_steps": 0 if graphs is None else graphs.padded_replays - padded_before,
            # median per decode step: the host phases (schedule, prepare, update) run while the GPU idles
            "step_phase_ms": {p: statistics.median(v) for p, v in phases.items() if v}}


def run_method(model_dir: Path, name: str, cfg: dict, args, storage: str | None = None,
               storage_cfg: dict | None = None) -> dict:
    t_start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=model_dir, load_format="dummy", dtype=args.dtype, device=args.device, method=name,
        method_config=cfg, kv_storage=storage, kv_storage_config=storage_cfg or {},
        page_size=args.page_size, enable_prefix_caching=False, max_num_seqs=args.max_batch,
        max_model_len=args.context + 4 * args.max_batch + timed_tokens(args) + 64,
        max_num_batched_tokens=max(args.window * args.admit_group, 256), kv_cache_memory_bytes=args.kv_bytes,
        cuda_graph_max_batch=min(args.max_batch, 512), decode_steps=args.decode_window,
        overlap_decode={"auto": None, "on": True, "off": False}[args.overlap_decode]))
    t_built = time.perf_counter()
    rng, gen = random.Random(0), torch.Generator(device=engine.device).manual_seed(0)
    max_tokens = 4 * args.max_batch + timed_tokens(args) + 32
    admitted, cut_by_time = 0, False
    while admitted < args.max_batch:
        if args.admit_time_limit and time.perf_counter() - t_built > args.admit_time_limit:
            cut_by_time = True  # the batch below is a lower bound on what the pool holds
            break
        added = 0
        while added < min(args.admit_group, args.max_batch - admitted) and has_room(engine, args, admitted + added):
            if not add_synthetic(engine, args.context, args.window, max_tokens, rng, gen):
                break
            added += 1
        if added == 0:
            break
        admitted += added
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine._requests.values()):
            engine.step()  # finish the new requests' window prefills (the others decode meanwhile)
        print(f"admitted {admitted} in {time.perf_counter() - t_built:.1f} s, {engine.pool.num_free} pages free",
              file=sys.stderr, flush=True)
    if admitted == 0:  # else the timed windows would wait forever for a request to decode
        raise RuntimeError(
            f"{name}: no request of {args.context} tokens fits the KV pool ({engine.pool.num_pages} pages of "
            f"{args.page_size} tokens, {engine.pool.num_free} free; one needs {-(-args.context // args.page_size)} "
            "and its growth): lower --max-batch (state slots and graph buffers are sized by it) or --context")
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        engine.step()
    sync()
    t_admitted = time.perf_counter()
    runs = [timed_decode(engine, args.decode_steps, sync) for _ in range(args.repeats)]
    t_timed = time.perf_counter()
    held = [engine.cache.num_pages_held(r) for r in engine._requests.values()]
    result = {"method": name if storage is None else f"{name}+{storage}", "config": cfg,
              "kv_storage": storage, "kv_storage_config": storage_cfg or {},
              "kv_bytes_per_token": engine.cache.spec.bytes_per_token, "batch": admitted, "context": args.context,
              "admission_cut_by_time": cut_by_time,
              **aggregate_runs(runs),
              "figure": "decode only: tokens of steps where every admitted request decodes; admission, "
                        "prefill, votes and compaction untimed (run_phase_s)",
              "pages_per_request": sum(held) / max(len(held), 1), "pool_pages": engine.pool.num_pages,
              "backend": engine.backend.name,
              "decode_window": args.decode_window, "overlap_decode": engine.overlap_decode,
              # where a run's wall time goes: engine build (weights, pool, graph capture), admission, timed steps
              "run_phase_s": {"build": t_built - t_start, "admit": t_admitted - t_built,
                              "timed": t_timed - t_admitted}}
    for rid in list(engine._requests):
        engine.abort(rid)
    del engine
    gc.collect()  # the engine holds reference cycles (runner <-> graphs); free its pool before the next one
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_isolated(*args) -> dict:
    """``run_method`` in a fresh process on a GPU (each engine sizes its pool from the whole free GPU memory,
    and a finished engine's memory is only certainly back once its process is gone); in-process elsewhere."""
    if not torch.cuda.is_available() or args[3].device == "cpu":
        return run_method(*args)
    with multiprocessing.get_context("spawn").Pool(1) as worker:
        return worker.apply(run_method, args)


def main(argv: list[str] | None = None) -> list[dict]:
    from engine.cli_args import positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--window", type=int, default=64, help="prompt tokens prefilled for real")
    ap.add_argument("--methods", default='dense;snapkv:{"budget":4096}')
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--decode-window", type=int, default=1,
                    help="decode steps run back to back per schedule (EngineConfig.decode_steps)")
    ap.add_argument("--overlap-decode", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.overlap_decode (auto: on a GPU)")
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="timed windows of --decode-steps each; figures are their median, with min and max")
    ap.add_argument("--kv-bytes", type=int, default=None, help="KV budget (default: GPU memory / 512 MiB CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json")
    ap.add_argument("--kv-storage", default=None, help="NAME[:JSON] for every spec that names no storage")
    ap.add_argument("--match-batch", action="store_true", help="also run the others at the dense batch")
    ap.add_argument("--matched-only", action="store_true",
                    help="run the others at the dense batch only (dense alone at its largest batch)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--admit-group", type=int, default=8, help="requests queued per admission round")
    ap.add_argument("--admit-time-limit", type=float, default=None,
                    help="stop admitting after this many seconds (the batch is then a lower bound)")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp))
        specs = parse_specs(args.methods, args.kv_storage)
        is_dense = [(name, storage) == ("dense", None) for name, _, storage, _ in specs]
        if args.matched_only and not any(is_dense):
            ap.error("--matched-only needs the dense spec (its batch is the one matched)")
        for spec, dense_spec in zip(specs, is_dense):
            if args.matched_only and not dense_spec:
                continue
            r = run_isolated(model_dir, spec[0], spec[1], args, spec[2], spec[3])
            print(json.dumps(r), flush=True)
            results.append(r)
        dense = next((r for r in results if r["method"] == "dense"), None)
        if (args.match_batch or args.matched_only) and dense is not None:
            matched = argparse.Namespace(**{**vars(args), "max_batch": dense["batch"]})
            for name, cfg, storage, scfg in specs:
                if (name, storage) != ("dense", None):
                    r = run_isolated(model_dir, name, cfg, matched, storage, scfg)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    base = next((r for r in results if r["method"] == "dense"), None)
    print(f"\ndecode only (admission and prefill untimed); median [min-max] of {args.repeats} timed windows")
    print(f"{'method':<14} {'batch':>5} {'decode tok/s':>26} {'step ms':>22} {'pages/req':>10} {'vs dense':>9} "
          f"{'KV B/token':>11}")
    for r in results:
        ratio = r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
        print(f"{r['method']:<14} {r['batch']:>5} {with_spread(r, 'decode_tok_s'):>26} "
              f"{with_spread(r, 'step_ms', '.2f'):>22} "
              f"{r['pages_per_request']:>10.1f} {ratio:>8.2f}x {r.get('kv_bytes_per_token', 0):>11}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
