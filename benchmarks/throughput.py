"""Offline throughput benchmark: prefill and decode tok/s for a batch, context length and model shape.

Model shapes come by name with random weights, so it runs where no weights can be downloaded (or --model
times a checkpoint directory). Prints one JSON object per case and a table. Decode tok/s is decode only: the
tokens produced after every request has its first token, over the time since (admission and prefill are
timed apart, as prefill tok/s); each figure is the median of --repeats runs, with min and max.

    agentrt bench --shape tiny --batch 1,32 --context 256 --decode-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from benchmarks.model_shapes import get_shape
from engine.sampling_params import SamplingParams
from engine.cli_args import checked_after_parsing


def write_shape_dir(shape: str, root: Path) -> Path:
    """config.json of the named shape plus the project's tokenizer; weights come from load_format='dummy'."""
    from engine.tiny_checkpoint import train_tokenizer

    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(get_shape(shape)))
    train_tokenizer().save_pretrained(out)
    return out


def output_counts(requests) -> list[int]:
    """Each request's own count of output tokens (it stays on the request after it finishes)."""
    return [r.num_output_tokens for r in requests]


class TimedTokens:
    """The output tokens ``requests`` produce inside a timed window, from each request's own counter.

    ``start()`` goes right after the device sync that opens the window. A decode window the engine launched
    before it (``overlap_decode``) has finished on the device by then, but its tokens reach the requests only
    with the next ``step()``: ``took()`` after that step moves the baseline past them (they are reported as
    ``excluded``), and says that step's decode steps are not the window's either."""

    def __init__(self, engine: LLMEngine, requests):
        self.engine, self.requests = engine, list(requests)
        self.base = output_counts(self.requests)
        self.excluded = 0
        self._in_flight = False

    def start(self) -> None:
        self._in_flight = self.engine._window_in_flight()
        self.base = output_counts(self.requests)
        self.excluded = 0

    def took(self) -> bool:
        """Call after every step() of the window: False for the one that took the window in flight at start."""
        if not self._in_flight:
            return True
        self._in_flight = False
        now = output_counts(self.requests)
        self.excluded = sum(a - b for a, b in zip(now, self.base))
        self.base = now
        return False

    def count(self) -> int:
        return sum(a - b for a, b in zip(output_counts(self.requests), self.base))


def replay_bucket(buckets, batch: int) -> int | None:
    """The decode-graph bucket whose replay is timed for a case of ``batch`` requests: the batch itself when it
    is a bucket, else None (its replay would carry padding rows, which read one KV slot each)."""
    return batch if batch in buckets else None


def is_full_bucket(rows: tuple[int, int] | None, bucket: int | None) -> bool:
    """Whether a replay's (live rows, bucket) is a full step of ``bucket``: every row a live request."""
    return bucket is not None and rows == (bucket, bucket)


class FullBucketReplay:
    """A decode graph replay timed on a full bucket only.

    ``DecodeGraphs.load`` pads the rows between a live batch and its bucket with one-slot KV, so a replay of a
    step whose live batch is below its bucket (the tail of a run, where requests that started decoding early
    finish first) reads less than a full step. The graphs' static inputs are copied at the first timed step
    whose live rows fill the case's bucket, and ``time_ms`` replays from that copy after the run. The copy is a
    handful of small device copies queued once inside the timed window."""

    BUFFERS = ("input_ids", "positions", "slot_mapping", "block_tables", "kv_lens", "window_ids", "quant_lens")

    def __init__(self, graphs, batch: int):
        self.graphs, self.batch = graphs, batch
        self.bucket = None if graphs is None else replay_bucket(graphs.buckets, batch)
        self.state: dict[str, torch.Tensor] | None = None

    def observe(self) -> None:
        """Call after every timed step: keep the static inputs of the first full-bucket replay."""
        g = self.graphs
        if self.state is None and g is not None and is_full_bucket(g.last_rows, self.bucket):
            self.state = {name: getattr(g, name).clone() for name in self.BUFFERS if hasattr(g, name)}

    def time_ms(self, reps: int = 20) -> float | None:
        """Milliseconds per replay of the kept full step (timed with CUDA events on a GPU), None when none was kept."""
        if self.state is None:
            return None
        g = self.graphs
        for name, value in self.state.items():
            getattr(g, name).copy_(value)
        graph = g.graphs[self.bucket]
        if not isinstance(graph, torch.cuda.CUDAGraph):  # a stand-in (tests): wall time
            t = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            return 1e3 * (time.perf_counter() - t) / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def rule(self) -> str:
        if self.graphs is None:
            return "no decode graphs"
        if self.bucket is None:
            buckets = ", ".join(map(str, self.graphs.buckets))
            return f"not timed: batch {self.batch} is not a graph bucket ({buckets}), so its replays carry padding rows"
        if self.state is None:
            return f"not timed: no timed step replayed a full bucket of {self.bucket}"
        return f"timed on a full bucket: a step whose {self.bucket} live rows fill bucket {self.bucket}"


def run_one(engine: LLMEngine, batch: int, context: int, decode_tokens: int, seed: int) -> dict:
    """One case: ``batch`` requests of ``context`` random tokens, each generating ``decode_tokens``.

    Prefill is timed from t0 to t1, the moment every request has its first token; decode from t1 to t2, the
    moment all have finished (each mark after a device sync). The scheduler serves running requests first, so
    requests whose prompts finished in earlier chunks decode inside the later prefill chunks: those tokens were
    produced before t1 and are not counted (``decode_tokens_before_t1``). What is counted is, per request, its
    output count at t2 minus at t1."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)]
    reqs = [engine._requests[i] for i in ids]
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while any(n == 0 for n in output_counts(reqs)):
        engine.step()
    sync()
    t1 = time.perf_counter()
    timed = TimedTokens(engine, reqs)
    timed.start()
    before_t1 = sum(timed.base) - batch  # tokens decoded inside later prefill chunks
    graphs = engine.runner.graphs
    replay = FullBucketReplay(graphs, batch)
    replays_before = graphs.replays if graphs is not None else 0
    padded_before = graphs.padded_replays if graphs is not None else 0
    overheads, steps = [], 0
    phases: dict[str, list[float]] = {"schedule": [], "prepare": [], "execute": [], "update": []}
    full_steps: list[float] = []  # wall time of each step in which every request decodes
    walls: list[tuple[float, int, int, int]] = []  # (ms, index in the window, decode steps, requests) per step()
    while engine.has_unfinished():
        ts = time.perf_counter()
        engine.step()
        te = time.perf_counter()
        counted = timed.took()
        replay.observe()
        timing = engine.last_step
        # a step() may run several decode steps, or (overlap_decode) only launch a window the next one takes
        k = timing.decode_steps if timing is not None and counted else 0
        steps += k
        walls.append((1e3 * (te - ts), len(walls), k, timing.num_requests if timing is not None else 0))
        if k and timing.num_requests == batch:  # per decode step from here on
            full_steps.append((te - ts) / k)
            overheads.append((timing.schedule_s + timing.prepare_s) / k)
            for name, values in phases.items():
                values.append(getattr(timing, f"{name}_s") / k)
    sync()
    t2 = time.perf_counter()
    decoded = timed.count()
    replayed = (graphs.replays - replays_before) if graphs is not None else 0
    padded = (graphs.padded_replays - padded_before) if graphs is not None else 0
    return {
        "batch": batch,
        "context": context,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": batch * context / (t1 - t0),
        # tokens produced between t1 and t2 (per request: its output count at t2 minus at t1) / (t2 - t1)
        "decode_tok_s": decoded / (t2 - t1) if decoded else 0.0,
        "decode_tokens_counted": decoded,
        "decode_tokens_before_t1": before_t1,
        "in_flight_tokens_excluded": timed.excluded,
        "decode_step_ms": 1e3 * (t2 - t1) / max(steps, 1),
        "sched_prep_ms_per_decode_step": 1e3 * statistics.median(overheads) if overheads else None,
        # median wall ms of each part of a full-batch decode step: execute = forward (graph replay) + sampling,
        # synchronised by the sampled ids' copy to the host; update = outputs, detokenization, finishing
        "step_phase_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items() if v},
        # one full-batch step's median wall time (no tail of a shrinking batch)
        "full_batch_step_ms": 1e3 * statistics.median(full_steps) if full_steps else None,
        # GPU time of one decode step of the full batch, host work excluded (graph_replay_rule says which step)
        "graph_replay_ms": replay.time_ms(),
        "graph_replay_rule": replay.rule(),
        # decode steps after t1, how many of them replayed a decode CUDA graph, and how many of those replays
        # carried padding rows (a live batch below its bucket)
        "timed_decode_steps": steps,
        # the window's three longest step() calls (wall ms, position among the window's calls, decode steps they
        # counted, requests): where a one-time cost inside the window sits
        "slowest_steps": [{"ms": ms, "index": i, "decode_steps": k, "requests": n}
                          for ms, i, k, n in sorted(walls, reverse=True)[:3]],
        "window_step_calls": len(walls),
        "graph_replayed_steps": replayed,
        "graph_padded_steps": padded,
    }


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements of one figure."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate_runs(runs: list[dict]) -> dict:
    """One result from repetitions of a run: every number is the median of its repetitions, with its min and
    max under ``spread`` (numbers in nested dicts alike); anything else is the first run's (the repetitions
    agree on it). ``repeats`` says how many there were."""
    out = dict(runs[0])
    spread: dict = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if all(_is_number(v) for v in values):
            s = summarize(values)
            out[key] = first if s["min"] == s["max"] else s["median"]
            spread[key] = {"min": s["min"], "max": s["max"]}
        elif isinstance(first, dict) and all(isinstance(v, dict) for v in values) and key != "spread":
            sub = aggregate_runs(values)
            sub.pop("repeats")
            sub_spread = sub.pop("spread")
            out[key] = sub
            if sub_spread:
                spread[key] = sub_spread
    out["repeats"] = len(runs)
    out["spread"] = spread
    return out


def with_spread(r: dict, key: str, fmt: str = ".1f") -> str:
    """``median [min-max]`` of a figure of an aggregated result, for tables."""
    value = r.get(key)
    if value is None:
        return "-"
    s = r.get("spread", {}).get(key)
    if not s or s["min"] == s["max"]:
        return format(value, fmt)
    return f"{value:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def add_roofline(r: dict, engine: LLMEngine, copy_bw: float, matmul: float, spec_bw: float | None = None) -> None:
    """Decode: weights + KV read per step against the copy rate measured in the run and against the card's spec
    bandwidth (None where the card is not known). Prefill: model FLOPs against the matmul rate."""
    from benchmarks.roofline import expected_expert_fraction, expert_weight_bytes, lm_head_params, weight_bytes

    mc = engine.model_config
    kv_per_token = engine.cache.spec.bytes_per_token
    avg_ctx = r["context"] + r["decode_tokens"] / 2
    w_bytes = weight_bytes(engine.model)
    itemsize = engine.cache.spec.dtype.itemsize
    params = w_bytes / itemsize
    if mc.num_experts:
        experts = expert_weight_bytes(engine.model)
        routed = r.get("routed_experts_per_layer")
        fraction = (routed / mc.num_experts if routed is not None
                    else expected_expert_fraction(mc.num_experts, mc.num_experts_per_tok, r["batch"]))
        w_bytes -= experts * (1 - fraction)
        params -= experts / itemsize * (1 - mc.num_experts_per_tok / mc.num_experts)
        r["routed_expert_fraction"] = fraction
        r["note"] = ("MoE: decode bytes count the distinct experts the batch routed to per layer, measured over "
                     "an eager rerun of the timed decode steps (same prompts, same number of steps)"
                     if routed is not None else
                     "MoE: decode bytes count the expected routed experts under uniform routing, 1-(1-k/E)^B")
    step_bytes = w_bytes + r["batch"] * avg_ctx * kv_per_token
    roofline_tok_s = r["batch"] / (step_bytes / copy_bw)
    spec_tok_s = r["batch"] / (step_bytes / spec_bw) if spec_bw else None
    full_tok_s = r["batch"] / (r["full_batch_step_ms"] * 1e-3) if r.get("full_batch_step_ms") else None
    attn_flops = 4 * mc.num_layers * mc.num_heads * mc.head_dim * r["context"] ** 2 / 2
    # logits are computed for each prompt's last token only: the LM head once per prompt, every other weight
    # once per prompt token (the input embedding is a gather, not counted)
    head = lm_head_params(engine.model)
    prefill_flops = r["batch"] * (2 * (params - head) * r["context"] + 2 * head + attn_flops)
    r.update(weight_gb=w_bytes / 1e9, bytes_per_step_gb=step_bytes / 1e9, copy_tb_s=copy_bw / 1e12,
             spec_tb_s=spec_bw / 1e12 if spec_bw else None,
             roofline_tok_s=roofline_tok_s, roofline_fraction=r["decode_tok_s"] / roofline_tok_s,
             spec_roofline_fraction=r["decode_tok_s"] / spec_tok_s if spec_tok_s else None,
             full_batch_roofline_fraction=full_tok_s / roofline_tok_s if full_tok_s else None,
             full_batch_spec_roofline_fraction=full_tok_s / spec_tok_s if full_tok_s and spec_tok_s else None,
             achieved_tb_s=r["decode_tok_s"] / r["batch"] * step_bytes / 1e12,
             prefill_tflop_s=prefill_flops / (r["batch"] * r["context"] / r["prefill_tok_s"]) / 1e12,
             matmul_tflop_s=matmul / 1e12)


def hf_decode(model_dir: Path, batch: int, context: int, decode_tokens: int, device: torch.device,
              dtype: torch.dtype = torch.bfloat16, compiled: bool = False, repeats: int = 3,
              compile_backend: str = "inductor") -> dict:
    """HF transformers ``generate`` (sdpa) on the same shape with its own random init, same batch and context.

    Eager (``compiled`` False): its default dynamic cache, every decode step launched from Python. Compiled:
    ``cache_implementation="static"`` with a ``CompileConfig``, transformers' own path that compiles the decode
    forward (``torch.compile``, mode reduce-overhead: CUDA graphs on a GPU) -- the fair baseline. Decode tok/s is
    ``batch * (n - 1)`` tokens over the time ``generate`` of n tokens takes beyond ``generate`` of one (prefill
    and first token cancel), the median of ``repeats``; the first call (the compile, and sizing the static
    cache for the longest call) is untimed and reported as ``*_warmup_s``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    ids = torch.randint(0, config.vocab_size, (batch, context), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    extra: dict = {}
    if compiled:
        from transformers import CompileConfig

        compile_config = CompileConfig(backend=compile_backend)
        if device.type != "cuda":
            compile_config._compile_all_devices = True  # generate compiles on a GPU only unless told
        extra = dict(cache_implementation="static", compile_config=compile_config)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, **extra)
        sync()
        return time.perf_counter() - t

    with torch.no_grad():
        warmup = timed(decode_tokens)  # compiles; a static cache is sized for the longest call from here on
        timed(1)
        rates = []
        for _ in range(repeats):
            t1, tn = timed(1), timed(decode_tokens)
            rates.append(batch * (decode_tokens - 1) / (tn - t1))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = "hf_compiled" if compiled else "hf"
    s = summarize(rates)
    return {f"{name}_decode_tok_s": s["median"], f"{name}_warmup_s": warmup,
            "spread": {f"{name}_decode_tok_s": {"min": s["min"], "max": s["max"]}}}


def run_cases(engine: LLMEngine, cases: list[tuple[int, int]], args: argparse.Namespace) -> list[dict]:
    """Every case in every overlap mode on one engine, each the aggregate of ``args.repeats`` runs, each a JSON
    line; the engine is closed after."""
    modes = [True, False] if args.overlap_decode == "both" else [engine.overlap_decode]
    on_gpu = engine.device.type == "cuda"
    if on_gpu:
        from benchmarks.roofline import copy_bandwidth, matmul_rate, spec_bandwidth

        copy_bw, matmul = copy_bandwidth(engine.device), matmul_rate(engine.device)
        gpu_name = torch.cuda.get_device_name(engine.device)
        spec_bw = spec_bandwidth(gpu_name)
    for ctx in sorted({c for _, c in cases}):  # compile kernels for these shapes before timing
        run_one(engine, 1, ctx, 4, args.seed)
    results = []
    fused = getattr(engine.model, "model", None) is not None and getattr(engine.model.model, "fused_decode_rows", 0) > 0
    for (b, ctx), overlap in itertools.product(cases, modes):
        engine.overlap_decode = overlap
        runs = [run_one(engine, b, ctx, args.decode_tokens, args.seed) for _ in range(args.repeats)]
        if on_gpu:
            routed = None
            if engine.model_config.num_experts:
                from benchmarks.roofline import measure_routed_experts

                # the timed run's prompts (run_one's seed and order) over as many decode passes: greedy
                # decoding repeats its tokens, so this counts the experts the timed steps routed to
                rng = random.Random(args.seed)
                vocab = engine.model_config.vocab_size
                routed = measure_routed_experts(
                    engine, [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(b)],
                    steps=args.decode_tokens - 1)
            for run in runs:
                if routed is not None:
                    run["routed_experts_per_layer"] = routed
                add_roofline(run, engine, copy_bw, matmul, spec_bw)
        r = aggregate_runs(runs)
        r.update(shape=args.model or args.shape, device=str(engine.device), dtype=str(engine.cache.spec.dtype),
                 backend=engine.backend.name, cuda_graphs=engine.runner.graphs is not None,
                 decode_steps=args.decode_steps, overlap_decode=overlap, fused_decode_linears=fused,
                 gpu_name=gpu_name if on_gpu else None)
        print(json.dumps(r), flush=True)
        results.append(r)
    engine.close()
    return results


def _cases(text: str) -> list[tuple[int, int]]:
    """batch@context pairs, e.g. 1@4096,8@4096."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, _, context = part.partition("@")
        try:
            case = (int(batch), int(context))
        except ValueError:
            case = (0, 0)
        if min(case) < 1:
            raise argparse.ArgumentTypeError(f"expected batch@context pairs of integers >= 1 such as "
                                             f"1@4096,8@4096, got {part!r}")
        cases.append(case)
    if not cases:
        raise argparse.ArgumentTypeError(f"expected batch@context pairs such as 1@4096,8@4096, got {text!r}")
    return cases


def _read_json(text: str) -> None:
    try:
        json.loads(Path(text).read_text())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text} is not JSON ({exc})") from None


def _parent_exists(text: str) -> None:
    if not Path(text).parent.is_dir():
        raise argparse.ArgumentTypeError(f"the directory of {text} does not exist")


@checked_after_parsing(_read_json)
def _json_file(text: str) -> str:
    return text


@checked_after_parsing(_parent_exists)
def _output_file(text: str) -> str:
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    from engine.attention_backend import BACKEND_NAMES
    from engine.config import DTYPES
    from benchmarks.model_shapes import SHAPES
    from engine.cli_args import CommandLineParser, checkpoint_dir, device, positive_int, positive_ints

    ap = CommandLineParser(prog="agentrt bench", description=__doc__)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), metavar="SHAPE",
                    help=f"a named model shape with random weights: {', '.join(sorted(SHAPES))}")
    ap.add_argument("--model", type=checkpoint_dir,
                    help="a checkpoint directory with weights instead of a named shape (default: --shape)")
    ap.add_argument("--batch", type=positive_ints, default=[1, 32], help="comma-separated batch sizes")
    ap.add_argument("--context", type=positive_int, default=256, help="prompt tokens of every request")
    ap.add_argument("--decode-tokens", type=positive_int, default=64, help="tokens generated per request")
    ap.add_argument("--device", type=device, default="auto", help="auto (a GPU when visible), cpu or cuda[:N]")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                    help="weights and KV dtype (auto: the checkpoint's or the shape's)")
    ap.add_argument("--page-size", type=positive_int, default=16, help="tokens a page of the KV pool")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                    help="token budget of one engine step (the prefill chunk)")
    ap.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES,
                    help="EngineConfig.attention_backend")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--enforce-eager", action="store_true", help="never replay decode CUDA graphs")
    ap.add_argument("--decode-steps", type=positive_int, default=1,
                    help="decode steps run back to back per schedule (EngineConfig.decode_steps)")
    ap.add_argument("--overlap-decode", choices=("auto", "on", "off", "both"), default="auto",
                    help="EngineConfig.overlap_decode (auto: on a GPU); both: each case "
                         "twice in the same engine, overlapped then not")
    ap.add_argument("--fused-decode-linears", nargs="?", const="on", default="auto",
                    choices=("auto", "on", "off", "both"),
                    help="EngineConfig.fused_decode_linears (auto: on a GPU): norms and SiLU-and-mul inside the "
                         "decode projections; both: every case without them, then in a second engine with them")
    ap.add_argument("--decode-linear-launches", type=_json_file,
                    help="the fused decode linears' launches from this benchmarks.decode_linear --json file")
    ap.add_argument("--hf", action="store_true",
                    help="also time HF transformers generate in the same run: eager (its dynamic cache), and with a "
                         "static cache and its decode forward compiled (--hf-compiled)")
    ap.add_argument("--hf-compiled", choices=("auto", "on", "off"), default="auto",
                    help="with --hf, the static-cache + torch.compile baseline (auto: on a GPU; slow to compile on "
                         "a CPU); its compile and warm-up time is reported apart and not in its tok/s")
    ap.add_argument("--hf-compile-backend", default="inductor",
                    help="torch.compile backend of the compiled HF baseline")
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="runs of each case; every figure is their median, with min and max (JSON: spread)")
    ap.add_argument("--cases", type=_cases,
                    help="batch@context pairs, e.g. 1@4096,8@4096,4@32768 (overrides --batch/--context)")
    ap.add_argument("--json", type=_output_file, help="write the results here too")
    args = ap.parse_args(argv)
    cases = args.cases or [(b, args.context) for b in args.batch]
    batches = [b for b, _ in cases]
    if args.decode_linear_launches:
        from agentrt_kernels.triton.decode_linear import load_tuned_launches

        load_tuned_launches(json.loads(Path(args.decode_linear_launches).read_text()))
    fused_modes = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.fused_decode_linears]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_shape_dir(args.shape, Path(tmp))
        tokens_per_req = max(c for _, c in cases) + args.decode_tokens
        results = []
        for fused in fused_modes:
            config = EngineConfig(
                model=model_dir, dtype=args.dtype, device=args.device,
                load_format="safetensors" if args.model else "dummy",
                max_num_seqs=max(batches), max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max(tokens_per_req + 1, 64), enable_prefix_caching=False,
                page_size=args.page_size,
                num_pages=max(b * (-(-(c + args.decode_tokens) // args.page_size) + 1) for b, c in cases),
                attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                decode_steps=args.decode_steps,
                overlap_decode={"auto": None, "off": False}.get(args.overlap_decode, True),
                fused_decode_linears=fused,
            )
            results += run_cases(LLMEngine(config), cases, args)
            gc.collect()  # the engine (its weights, pool and graphs) goes before the next one or HF loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        on_gpu = results[0]["device"].startswith("cuda")
        if args.hf:
            compiled_too = {"auto": on_gpu, "on": True, "off": False}[args.hf_compiled]
            hf: dict[tuple[int, int], dict] = {}  # one HF run per case, whatever the overlap modes
            for r in results:
                case = (r["batch"], r["context"])
                if case not in hf:
                    device = torch.device(r["device"])
                    dtype = getattr(torch, r["dtype"].removeprefix("torch."))
                    hf[case] = hf_decode(Path(model_dir), *case, args.decode_tokens, device, dtype,
                                         repeats=args.repeats)
                    if compiled_too:
                        compiled = hf_decode(Path(model_dir), *case, args.decode_tokens, device, dtype,
                                             compiled=True, repeats=args.repeats,
                                             compile_backend=args.hf_compile_backend)
                        hf[case]["spread"].update(compiled.pop("spread"))
                        hf[case].update(compiled)
                figures = dict(hf[case])
                r["spread"].update(figures.pop("spread"))
                r.update(figures)
                r["speedup_vs_hf"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
                if "hf_compiled_decode_tok_s" in r:
                    r["speedup_vs_hf_compiled"] = r["decode_tok_s"] / r["hf_compiled_decode_tok_s"]
                print(json.dumps(r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nmedian [min-max] of {args.repeats} runs; decode tok/s counts the tokens produced between the "
          "moment every request has its first token and the end")
    print(f"{'batch':>5} {'context':>7} {'overlap':>7} {'fused':>5} {'prefill tok/s':>26} {'decode tok/s':>26} "
          f"{'step ms':>20} {'sched+prep ms':>14}")
    for r in results:
        sp = r["sched_prep_ms_per_decode_step"]
        extra = ""
        if "roofline_fraction" in r:
            extra = (f"  roofline {with_spread(r, 'roofline_fraction', '.2f')} of copy "
                     f"({r['copy_tb_s']:.2f} TB/s), ")
            if r.get("spec_roofline_fraction") is not None:
                extra += f"{with_spread(r, 'spec_roofline_fraction', '.2f')} of spec ({r['spec_tb_s']:.2f} TB/s), "
            extra += f"prefill {with_spread(r, 'prefill_tflop_s', '.0f')} TFLOP/s"
            if r.get("full_batch_roofline_fraction") is not None:
                extra += (f"  full-batch step {with_spread(r, 'full_batch_step_ms', '.2f')} ms, roofline "
                          f"{r['full_batch_roofline_fraction']:.2f}")
        if r.get("graph_replay_ms") is not None:
            extra += f"  replay {with_spread(r, 'graph_replay_ms', '.2f')} ms (full bucket)"
        if "speedup_vs_hf" in r:
            extra += f"  HF eager {r['hf_decode_tok_s']:.1f} tok/s ({r['speedup_vs_hf']:.1f}x)"
        if "speedup_vs_hf_compiled" in r:
            extra += (f"  HF static+compile {r['hf_compiled_decode_tok_s']:.1f} tok/s "
                      f"({r['speedup_vs_hf_compiled']:.1f}x; warm-up {r['hf_compiled_warmup_s']:.0f} s untimed)")
        extra += (f"  graphs {r['graph_replayed_steps']}/{r['timed_decode_steps']} steps"
                  f" ({r['graph_padded_steps']} padded)")
        if r.get("slowest_steps"):
            top = r["slowest_steps"][0]
            extra += f"  slowest step() {top['ms']:.1f} ms (call {top['index'] + 1}/{r['window_step_calls']})"
        print(f"{r['batch']:>5} {r['context']:>7} {str(r['overlap_decode']):>7} {str(r['fused_decode_linears']):>5} "
              f"{with_spread(r, 'prefill_tok_s'):>26} {with_spread(r, 'decode_tok_s'):>26} "
              f"{with_spread(r, 'decode_step_ms', '.2f'):>20} {sp if sp is None else round(sp, 3):>14}{extra}")
    return results


if __name__ == "__main__":
    main()
