"""Offline throughput benchmark: prefill and decode tok/s for a batch, context length and model shape.

Model shapes come by name with random weights, so it runs where no weights can be downloaded (or --model
times a checkpoint directory). Prints one JSON object per run and a table.

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
from engine.model_shapes import get_shape
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


def run_one(engine: LLMEngine, batch: int, context: int, decode_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    first_tokens = 0
    while first_tokens < batch:
        first_tokens += sum(1 for o in engine.step() if len(o.token_ids) == 1)
    sync()
    t1 = time.perf_counter()
    graphs = engine.runner.graphs
    replays_before = graphs.replays if graphs is not None else 0
    overheads, steps = [], 0
    phases: dict[str, list[float]] = {"schedule": [], "prepare": [], "execute": [], "update": []}
    full_steps: list[float] = []  # wall time of each step in which every request decodes
    while engine.has_unfinished():
        ts = time.perf_counter()
        engine.step()
        te = time.perf_counter()
        timing = engine.last_step
        # a step() may run several decode steps, or (overlap_decode) only launch a window the next one takes
        k = timing.decode_steps if timing is not None else 0
        steps += k
        if timing is not None and timing.num_requests == batch:  # per decode step from here on
            full_steps.append((te - ts) / k)
            overheads.append((timing.schedule_s + timing.prepare_s) / k)
            for name, values in phases.items():
                values.append(getattr(timing, f"{name}_s") / k)
    sync()
    t2 = time.perf_counter()
    decoded = batch * (decode_tokens - 1)
    replayed = (graphs.replays - replays_before) if graphs is not None else 0
    replay_ms = None
    if graphs is not None and batch in graphs.graphs:  # GPU time of one decode step, host work excluded
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.graphs[batch].replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / 20
    return {
        "batch": batch,
        "context": context,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": batch * context / (t1 - t0),
        "decode_tok_s": decoded / (t2 - t1) if decoded else 0.0,
        "decode_step_ms": 1e3 * (t2 - t1) / max(steps, 1),
        "sched_prep_ms_per_decode_step": 1e3 * statistics.median(overheads) if overheads else None,
        # median wall ms of each part of a full-batch decode step: execute = forward (graph replay) + sampling,
        # synchronised by the sampled ids' copy to the host; update = outputs, detokenization, finishing
        "step_phase_ms": {k: 1e3 * statistics.median(v) for k, v in phases.items() if v},
        # decode_tok_s divides every token decoded after the last first token by the time since; this one is
        # one full-batch step's median wall time (no tail of a shrinking batch, no prefill-era tokens)
        "full_batch_step_ms": 1e3 * statistics.median(full_steps) if full_steps else None,
        "graph_replay_ms": replay_ms,
        # decode steps after the last first token, and how many of them replayed a decode CUDA graph
        "timed_decode_steps": steps,
        "graph_replayed_steps": replayed,
    }


def add_roofline(r: dict, engine: LLMEngine, copy_bw: float, matmul: float) -> None:
    """Decode: weights + KV read per step vs the copy bandwidth. Prefill: model FLOPs vs the matmul rate."""
    from engine.roofline import expected_expert_fraction, expert_weight_bytes, weight_bytes

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
    attn_flops = 4 * mc.num_layers * mc.num_heads * mc.head_dim * r["context"] ** 2 / 2
    prefill_flops = r["batch"] * (2 * params * r["context"] + attn_flops)
    r.update(weight_gb=w_bytes / 1e9, bytes_per_step_gb=step_bytes / 1e9, copy_tb_s=copy_bw / 1e12,
             roofline_tok_s=roofline_tok_s, roofline_fraction=r["decode_tok_s"] / roofline_tok_s,
             full_batch_roofline_fraction=(r["batch"] / (r["full_batch_step_ms"] * 1e-3) / roofline_tok_s
                                           if r.get("full_batch_step_ms") else None),
             achieved_tb_s=r["decode_tok_s"] / r["batch"] * step_bytes / 1e12,
             prefill_tflop_s=prefill_flops / (r["batch"] * r["context"] / r["prefill_tok_s"]) / 1e12,
             matmul_tflop_s=matmul / 1e12)


def hf_decode(model_dir: Path, batch: int, context: int, decode_tokens: int, device: torch.device) -> dict:
    """HF transformers generate (sdpa) on the same shape with its own random init, same batch and context."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids = torch.randint(0, config.vocab_size, (batch, context), device=device)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.no_grad():
        timed(2)
        t1, tn = timed(1), timed(decode_tokens)
    del model
    torch.cuda.empty_cache()
    return {"hf_decode_tok_s": batch * (decode_tokens - 1) / (tn - t1)}


def run_cases(engine: LLMEngine, cases: list[tuple[int, int]], args: argparse.Namespace) -> list[dict]:
    """Every case in every overlap mode on one engine, each a JSON line; the engine is closed after."""
    modes = [True, False] if args.overlap_decode == "both" else [engine.overlap_decode]
    on_gpu = engine.device.type == "cuda"
    if on_gpu:
        from engine.roofline import copy_bandwidth, matmul_rate

        copy_bw, matmul = copy_bandwidth(engine.device), matmul_rate(engine.device)
    for ctx in sorted({c for _, c in cases}):  # compile kernels for these shapes before timing
        run_one(engine, 1, ctx, 4, args.seed)
    results = []
    fused = getattr(engine.model, "model", None) is not None and getattr(engine.model.model, "fused_decode_rows", 0) > 0
    for (b, ctx), overlap in itertools.product(cases, modes):
        engine.overlap_decode = overlap
        r = run_one(engine, b, ctx, args.decode_tokens, args.seed)
        r.update(shape=args.model or args.shape, device=str(engine.device), dtype=str(engine.cache.spec.dtype),
                 backend=engine.backend.name, cuda_graphs=engine.runner.graphs is not None,
                 decode_steps=args.decode_steps, overlap_decode=overlap, fused_decode_linears=fused)
        if on_gpu:
            if engine.model_config.num_experts:
                from engine.roofline import measure_routed_experts

                # the timed run's prompts (run_one's seed and order) over as many decode passes: greedy
                # decoding repeats its tokens, so this counts the experts the timed steps routed to
                rng = random.Random(args.seed)
                vocab = engine.model_config.vocab_size
                r["routed_experts_per_layer"] = measure_routed_experts(
                    engine, [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(b)],
                    steps=args.decode_tokens - 1)
            add_roofline(r, engine, copy_bw, matmul)
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
    from engine.model_shapes import SHAPES
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
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate (GPU) in the same run")
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
                num_pages=max(b * (-(-(c + args.decode_tokens) // 16) + 1) for b, c in cases),
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
        if args.hf and on_gpu:
            hf: dict[tuple[int, int], dict] = {}  # one HF run per case, whatever the overlap modes
            for r in results:
                case = (r["batch"], r["context"])
                if case not in hf:
                    hf[case] = hf_decode(Path(model_dir), *case, args.decode_tokens, torch.device("cuda"))
                r.update(hf[case])
                r["speedup_vs_hf"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
                print(json.dumps(r), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{'batch':>5} {'context':>7} {'overlap':>7} {'fused':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'step ms':>8} "
          f"{'sched+prep ms':>14}")
    for r in results:
        sp = r["sched_prep_ms_per_decode_step"]
        extra = ""
        if "roofline_fraction" in r:
            extra = f"  roofline {r['roofline_fraction']:.2f} ({r['achieved_tb_s']:.2f} TB/s)  prefill {r['prefill_tflop_s']:.0f} TFLOP/s"
            if r.get("full_batch_roofline_fraction") is not None:
                extra += (f"  full-batch step {r['full_batch_step_ms']:.2f} ms, roofline "
                          f"{r['full_batch_roofline_fraction']:.2f}")
        if "speedup_vs_hf" in r:
            extra += f"  HF {r['hf_decode_tok_s']:.1f} tok/s ({r['speedup_vs_hf']:.1f}x)"
        extra += f"  graphs {r['graph_replayed_steps']}/{r['timed_decode_steps']} steps"
        print(f"{r['batch']:>5} {r['context']:>7} {str(r['overlap_decode']):>7} {str(r['fused_decode_linears']):>5} "
              f"{r['prefill_tok_s']:>14.1f} "
              f"{r['decode_tok_s']:>13.1f} "
              f"{r['decode_step_ms']:>8.2f} {sp if sp is None else round(sp, 3):>14}{extra}")
    return results


if __name__ == "__main__":
    main()
