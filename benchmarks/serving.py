"""Serving benchmark: requests arriving over time through the engine's step API, everything a user pays timed.

Requests of ``--input-len`` random prompt tokens, each generating exactly its output length, arrive either as
a Poisson process (``--rate`` requests per second) or from ``--concurrency`` closed-loop clients (each sends
its next request when its last one has finished). They go through ``LLMEngine.add_request`` / ``step`` as a
server would drive it: real chunked prefill of every prompt, each method's votes and compaction at a prompt's
end, decode, and the wait for admission. The driver admits a request only when the KV pool can hold it and
still let every admitted request grow to its end (no preemption); until then it waits, and that wait is part
of its time to first token. ``--concurrency auto`` is the largest concurrency the pool sustains: the pool's
pages over the pages one request holds at its last token (measured on an untimed warm-up request after its
prompt), capped by ``--max-batch``.

Per method config and output length: request throughput, output tok/s (every token a client received, over
the time from the first arrival to the last finish), TTFT (arrival to first token) and TPOT ((finish - first
token) / (tokens - 1)) p50 / p99, each the median of ``--repeats`` runs with min and max. This is the
companion of the decode-only figures of ``benchmarks.throughput`` and ``benchmarks.sparse_decode``, which time only
steps where every admitted request decodes.

    python -m benchmarks.serving --shape llama-3.1-8b --input-len 114688 --output-lens 1024,4096,16384
    python -m benchmarks.serving --shape tiny --input-len 256 --output-lens 16 --num-requests 8 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.throughput import aggregate_runs, with_spread, write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

DEFAULT_METHODS = ('dense;snapkv:{"budget":4096};quest:{"token_budget":4096};omnikv:{"token_budget":4096};'
                   'snapkv:{"budget":4096}+fp8')


@dataclass
class RequestRecord:
    """One request's times, in seconds from the start of the run."""

    request_id: str
    arrival: float  # when its client sent it
    admitted: float | None = None  # when the driver handed it to the engine
    first_token: float | None = None  # when the step that returned its first token came back
    finish: float | None = None  # when the step that returned it finished came back
    tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (finish - first token) / (tokens - 1)."""
        if self.finish is None or self.first_token is None or self.tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


def record_outputs(records: dict[str, RequestRecord], outputs, now: float) -> list[str]:
    """Fold one step's outputs, which the host had at ``now``, into the records (a window of decode steps
    returns several tokens at once: they share its time). Returns the ids of the requests that finished."""
    finished = []
    for out in outputs:
        rec = records[out.request_id]
        if out.new_token_ids and rec.first_token is None:
            rec.first_token = now
        rec.tokens += len(out.new_token_ids)
        if out.finished:
            rec.finish = now
            finished.append(out.request_id)
    return finished


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_requests(records: list[RequestRecord]) -> dict:
    """Throughput over the span from the first arrival to the last finish, and the latency percentiles."""
    done = [r for r in records if r.finish is not None]
    start = min(r.arrival for r in records)
    end = max(r.finish for r in done) if done else start
    span = max(end - start, 1e-12)
    out = {"completed": len(done), "duration_s": span, "request_throughput": len(done) / span,
           "output_tok_s": sum(r.tokens for r in records) / span}
    for name in ("ttft", "tpot", "e2e"):
        values = [1e3 * v for r in done if (v := getattr(r, name)) is not None]
        out[f"{name}_ms_p50"] = percentile(values, 50)
        out[f"{name}_ms_p99"] = percentile(values, 99)
        out[f"{name}_ms_mean"] = sum(values) / len(values) if values else None
    waits = [1e3 * (r.admitted - r.arrival) for r in done if r.admitted is not None]
    out["admission_wait_ms_p50"] = percentile(waits, 50)
    out["admission_wait_ms_p99"] = percentile(waits, 99)
    return out


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (s) of n requests at ``rate`` per second; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_still_needed(engine: LLMEngine) -> int:
    """Pages the requests in the engine may still take before they finish, beyond those they hold: a request
    still in its prompt up to its admission peak (its method's ``max_physical_tokens``), one past its prompt by
    its remaining output (methods that compact have done so by then)."""
    cache, page = engine.cache, engine.config.page_size
    chunk = engine.config.max_num_batched_tokens
    total = 0
    for req in engine._requests.values():
        held = cache.num_pages_held(req)
        if req.num_computed_tokens < req.num_prompt_tokens or not cache.holds(req):
            peak = req.method.max_physical_tokens(req.num_prompt_tokens, req.params.max_tokens, chunk)
            total += max(0, _cdiv(peak, page) + 1 - held)
        else:
            total += cache.pages_needed(req, max(0, req.params.max_tokens - req.num_output_tokens))
    return total


def fits(engine: LLMEngine, input_len: int, output_len: int) -> bool:
    """Whether one more request of this size can be admitted so that no request will be preempted."""
    peak = engine.method.max_physical_tokens(input_len, output_len, engine.config.max_num_batched_tokens)
    return pages_still_needed(engine) + _cdiv(peak, engine.config.page_size) + 1 <= engine.pool.num_free


def drive(engine: LLMEngine, prompts: list[list[int]], output_len: int, *, rate: float | None = None,
          concurrency: int | None = None, rng: random.Random | None = None, tag: str = "",
          clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> dict:
    """Run the requests through the engine: Poisson arrivals at ``rate``, or ``concurrency`` closed-loop
    clients. Returns the per-request records and what the engine did (steps by kind, running requests)."""
    n = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    arrivals = poisson_arrivals(n, rate, rng or random.Random(0)) if rate is not None else None
    slots = deque([0.0] * min(concurrency or n, n))  # closed loop: when each client may send its next request
    queue: deque[tuple[int, float]] = deque()  # sent by their clients, not yet handed to the engine
    records: dict[str, RequestRecord] = {}
    kinds: dict[str, dict[str, float]] = {}
    running_s = busy_s = 0.0
    max_running, sent, done = 0, 0, 0
    preempted_before = engine.scheduler.num_preemptions
    input_len = len(prompts[0])
    t0 = clock()
    while done < n:
        now = clock() - t0
        if arrivals is not None:
            while sent < n and arrivals[sent] <= now:
                queue.append((sent, arrivals[sent]))
                sent += 1
        else:
            while sent < n and slots:
                queue.append((sent, slots.popleft()))
                sent += 1
        while queue and (not engine.has_unfinished() or fits(engine, input_len, output_len)):
            i, arrival = queue.popleft()
            rid = engine.add_request(prompts[i], params, request_id=f"{tag}{i}")
            records[rid] = RequestRecord(rid, arrival, admitted=clock() - t0)
        if not engine.has_unfinished():
            if arrivals is not None and sent < n:
                sleep(max(0.0, arrivals[sent] - (clock() - t0)))
            continue
        running = len(engine.scheduler.running)
        ts = clock()
        outputs = engine.step()
        te = clock()
        timing = engine.last_step
        kind = timing.kind if timing is not None else "decode-launch"  # an overlapped window's first launch
        k = kinds.setdefault(kind, {"steps": 0, "s": 0.0})
        k["steps"] += 1
        k["s"] += te - ts
        running = max(running, len(engine.scheduler.running))
        running_s += running * (te - ts)
        busy_s += te - ts
        max_running = max(max_running, running)
        for rid in record_outputs(records, outputs, te - t0):
            done += 1
            slots.append(records[rid].finish)
    return {"records": list(records.values()), "step_kinds": kinds,
            "mean_running": running_s / busy_s if busy_s else 0.0, "max_running": max_running,
            "preemptions": engine.scheduler.num_preemptions - preempted_before}


def warm_up(engine: LLMEngine, prompt: list[int]) -> dict:
    """One untimed request (compiles kernels, captures nothing new): the pages it holds right after its prompt
    (after a method's compaction) size ``--concurrency auto``."""
    t = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                             request_id="warm-up")
    req = engine._requests[rid]
    pages = None
    while engine.has_unfinished():
        engine.step()
        if pages is None and req.num_output_tokens >= 1:
            pages = engine.cache.num_pages_held(req)
    return {"warmup_s": time.perf_counter() - t, "pages_after_prompt": pages}


def parse_specs(text: str) -> list[tuple[str, dict, str | None, dict]]:
    from benchmarks.sparse_decode import parse_specs as parse

    return parse(text, None)


def run_method(model_dir: Path, spec: tuple[str, dict, str | None, dict], args) -> list[dict]:
    name, cfg, storage, storage_cfg = spec
    t_start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=model_dir, load_format="safetensors" if args.model else "dummy", dtype=args.dtype,
        device=args.device, method=name, method_config=cfg, kv_storage=storage, kv_storage_config=storage_cfg,
        page_size=args.page_size, enable_prefix_caching=False, max_num_seqs=args.max_batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + max(args.output_lens), kv_cache_memory_bytes=args.kv_bytes,
        num_pages=args.num_pages, cuda_graph_max_batch=min(args.max_batch, 512), decode_steps=args.decode_steps,
        overlap_decode={"auto": None, "on": True, "off": False}[args.overlap_decode],
        attention_backend=args.attention_backend))
    build_s = time.perf_counter() - t_start
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    warm = warm_up(engine, prompts[0])
    label = name if storage is None else f"{name}+{storage}"
    results = []
    for output_len in args.output_lens:
        per_request = warm["pages_after_prompt"] + _cdiv(output_len, args.page_size) + 1
        if args.rate is not None:
            concurrency = None
        elif args.concurrency == "auto":
            concurrency = max(1, min(args.max_batch, args.num_requests, engine.pool.num_pages // per_request))
        else:
            concurrency = int(args.concurrency)
        runs = []
        for rep in range(args.repeats):
            report = drive(engine, prompts, output_len, rate=args.rate, concurrency=concurrency,
                           rng=random.Random(args.seed), tag=f"{rep}-")
            run = summarize_requests(report.pop("records"))
            run.update(report)
            runs.append(run)
            print(f"{label} output {output_len} run {rep + 1}/{args.repeats}: {run['output_tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        r = aggregate_runs(runs)
        r = {"method": label, "config": cfg, "kv_storage": storage, "kv_storage_config": storage_cfg,
             "input_len": args.input_len, "output_len": output_len, "num_requests": args.num_requests,
             "arrivals": "closed-loop" if args.rate is None else "poisson", "rate": args.rate,
             "concurrency": concurrency, "concurrency_rule": (
                 "auto: pool pages // pages a request holds at its last token (warm-up after its prompt "
                 "+ output), capped by --max-batch and --num-requests" if args.concurrency == "auto"
                 and args.rate is None else "given"),
             **r, "pool_pages": engine.pool.num_pages, "pages_per_request_at_end": per_request,
             # build_s includes the engine's own warm-up prefill (engine.warmup: on a GPU) of these tokens
             "build_s": build_s, "engine_warmup_tokens": engine.warmup_tokens, **warm,
             "backend": engine.backend.name, "device": str(engine.device),
             "cuda_graphs": engine.runner.graphs is not None, "decode_steps": args.decode_steps,
             "overlap_decode": engine.overlap_decode,
             "timed": "from the first arrival to the last finish: admission waits, every prompt's prefill, "
                      "methods' votes and compaction, decode; tokens are those every client received"}
        print(json.dumps(r), flush=True)
        results.append(r)
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def run_isolated(model_dir: Path, spec, args) -> list[dict]:
    """``run_method`` in a fresh process on a GPU (each engine sizes its pool from the whole free memory);
    in-process on a CPU."""
    if not torch.cuda.is_available() or args.device == "cpu":
        return run_method(model_dir, spec, args)
    with multiprocessing.get_context("spawn").Pool(1) as worker:
        return worker.apply(run_method, (model_dir, spec, args))


def _concurrency(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 1, got {text!r}")
    return text


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 (inf: all at once), got {text!r}")
    return rate


def print_table(results: list[dict]) -> None:
    print(f"\nmedian [min-max] of {results[0]['repeats'] if results else 0} runs; everything a client waits for "
          "is timed (admission, prefill, votes and compaction, decode)")
    print(f"{'method':<24} {'in':>7} {'out':>6} {'conc':>5} {'req/s':>8} {'output tok/s':>28} {'TTFT p50/p99 ms':>20} "
          f"{'TPOT p50/p99 ms':>18} {'vs dense':>8}")
    for r in results:
        base = next((d for d in results if d["method"] == "dense" and d["output_len"] == r["output_len"]), None)
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
        conc = r["concurrency"] if r["concurrency"] is not None else "-"
        print(f"{r['method']:<24} {r['input_len']:>7} {r['output_len']:>6} {conc:>5} {r['request_throughput']:>8.3f} "
              f"{with_spread(r, 'output_tok_s'):>28} "
              f"{r['ttft_ms_p50']:>9.1f}/{r['ttft_ms_p99']:<10.1f} {r['tpot_ms_p50']:>8.2f}/{r['tpot_ms_p99']:<9.2f} "
              f"{ratio:>8}")


def main(argv: list[str] | None = None) -> list[dict]:
    from engine.attention_backend import BACKEND_NAMES
    from engine.cli_args import checkpoint_dir, device, positive_int, positive_ints
    from engine.config import DTYPES
    from benchmarks.model_shapes import SHAPES

    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="a named shape with random weights")
    ap.add_argument("--model", type=checkpoint_dir, help="a checkpoint directory instead of --shape")
    ap.add_argument("--input-len", type=positive_int, default=1024, help="prompt tokens of every request")
    ap.add_argument("--output-lens", type=positive_ints, default=[128],
                    help="comma-separated output lengths: one run per length")
    ap.add_argument("--num-requests", type=positive_int, default=32, help="requests per run")
    ap.add_argument("--rate", type=_rate, default=None,
                    help="Poisson arrivals at this many requests per second (default: closed loop)")
    ap.add_argument("--concurrency", type=_concurrency, default="auto",
                    help="closed-loop clients (auto: the largest the KV pool sustains)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="METHOD[:JSON][+STORAGE[:JSON]] specs separated by ';', each in its own engine")
    ap.add_argument("--max-batch", type=positive_int, default=256, help="EngineConfig.max_num_seqs")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                    help="token budget of one step (the prefill chunk)")
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--kv-bytes", type=positive_int, default=None,
                    help="KV budget in bytes (default: the engine's, from GPU memory; 512 MiB on a CPU)")
    ap.add_argument("--num-pages", type=positive_int, default=None, help="KV pool pages (overrides --kv-bytes)")
    ap.add_argument("--decode-steps", type=positive_int, default=1, help="EngineConfig.decode_steps")
    ap.add_argument("--overlap-decode", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.overlap_decode (auto: on a GPU)")
    ap.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES)
    ap.add_argument("--device", type=device, default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="runs of each configuration; figures are their median, with min and max")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_shape_dir(args.shape, Path(tmp))
        positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
        if positions and args.input_len + max(args.output_lens) > positions:
            ap.error(f"--input-len {args.input_len} + the longest of --output-lens ({max(args.output_lens)}) exceeds "
                     f"the model's {positions} positions: shorten the prompts to at most "
                     f"{positions - max(args.output_lens)}")
        for spec in parse_specs(args.methods):
            results += run_isolated(model_dir, spec, args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
