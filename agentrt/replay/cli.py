"""``agentrt replay``: generate synthetic traces, and replay traces against in-process servers.

    agentrt replay gen --out traces/ --num 16 --seed 0                       # the issue's shape (30-50 turns)
    agentrt replay run --traces traces/ --configs dense-prefix,dense-chain,dense-chain-lag --out results/
    agentrt replay run --sessions 4 --turns 6,8 --system-tokens 300 --tool-tokens 50,300   # generate inline
    agentrt replay run --shape llama-3.1-8b --load-format dummy --sessions 16 --turns 30,30 ...  # GPU
    agentrt replay plot results/replay.json                                  # the PNGs of a report
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from agentrt.replay.synth import SynthShape, SynthShapeError, synth_traces
from agentrt.replay.trace import Trace, TraceError, load, write_many


def _range(text: str, kind: type = int) -> tuple[Any, Any]:
    parts = [kind(p) for p in text.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected LO,HI or N, got {text!r}")
    return (parts[0], parts[-1])


def _shape_args(p: argparse.ArgumentParser) -> None:
    d = SynthShape()
    p.add_argument("--num", "--sessions", dest="num", type=int, default=16, help="traces (= concurrent sessions)")
    p.add_argument("--seed", type=int, default=0, help="trace i uses seed + i")
    p.add_argument("--turns", type=_range, default=d.num_turns, help="LO,HI turns per trace")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--task-tokens", type=_range, default=d.task_tokens)
    p.add_argument("--tool-tokens", type=_range, default=d.tool_tokens, help="LO,HI tokens of a tool result")
    p.add_argument("--output-tokens", type=_range, default=d.output_tokens, help="LO,HI recorded assistant tokens")
    p.add_argument("--think-time", type=lambda s: _range(s, float), default=d.think_time_s, help="LO,HI seconds")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--shape", help="a named model shape (engine.model_shapes) with the project tokenizer; "
                                   "weights: --load-format dummy")


def _model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.model and args.shape:
        raise SystemExit("give --model or --shape, not both")
    if args.shape:
        from engine.bench import write_shape_dir

        return write_shape_dir(args.shape, tmp)
    if args.model:
        return Path(args.model)
    from engine.tiny_checkpoint import default_model_dir

    return default_model_dir()


def _generate(args: argparse.Namespace, model_dir: Path) -> list[Trace]:
    from engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.model_max_length = 2**62
    config_vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", len(tokenizer))
    vocab = min(len(tokenizer), int(config_vocab))  # forced ids must be ids of both
    shape = SynthShape(num_turns=args.turns, system_tokens=args.system_tokens, task_tokens=args.task_tokens,
                       tool_tokens=args.tool_tokens, output_tokens=args.output_tokens, think_time_s=args.think_time)
    return synth_traces(tokenizer, args.num, args.seed, shape, tokenizer_name=model_dir.name, vocab_size=vocab)


def _gen(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="agentrt-shape-") as tmp:
        traces = _generate(args, _model_dir(args, Path(tmp)))
    for path in write_many(traces, args.out):
        print(path)
    return 0


def _run(args: argparse.Namespace) -> int:
    from agentrt.replay.bench import run_all, standard_configs
    from agentrt.replay.report import steps_table, summarize, table, with_speedups

    known = standard_configs(json.loads(args.snapkv_config), {"lag": args.lag})
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"agentrt replay: unknown configuration(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    engine_options: dict[str, Any] = {"device": args.device, "max_num_seqs": max(64, args.num),
                                      **json.loads(args.engine_options)}
    for key in ("dtype", "load_format", "num_pages", "max_num_batched_tokens", "gpu_memory_utilization"):
        if getattr(args, key) is not None:
            engine_options[key] = getattr(args, key)
    with tempfile.TemporaryDirectory(prefix="agentrt-shape-") as tmp:
        model_dir = _model_dir(args, Path(tmp))
        if args.traces:
            files = sorted(Path(args.traces).glob("*.jsonl")) if Path(args.traces).is_dir() else [Path(args.traces)]
            traces = [load(f) for f in files][: args.num]
        else:
            traces = _generate(args, model_dir)
        log = (lambda m: print(m, file=sys.stderr, flush=True))
        runs = run_all(traces, [known[n] for n in names], log, on_result=_partial_writer(args.out),
                       model=model_dir, engine_options=engine_options, think_scale=args.think_scale)
    summaries = with_speedups([summarize(r) for r in runs], args.baseline)
    report = {"model": args.shape or args.model or "embedded tiny", "engine_options": engine_options,
              "sessions": len(traces), "turns_per_session": [t.num_turns for t in traces],
              "think_scale": args.think_scale, "results": summaries}
    print(json.dumps(report, indent=1))
    print(table(summaries))
    print("\nengine steps by kind (count / wall s):")
    print(steps_table(summaries))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(report, indent=1))
        try:
            from agentrt.replay.plots import write_plots

            for path in write_plots(summaries, out):
                print(f"wrote {path}", file=sys.stderr)
        except ImportError:
            print("matplotlib is not installed (pip install 'agentrt[replay]'): no plots", file=sys.stderr)
    return 0


def _partial_writer(out: str | None):
    """Append each configuration's summary to ``out/partial.jsonl`` as it ends (kept if a later one dies)."""
    from agentrt.replay.report import summarize

    if not out:
        return None
    path = Path(out) / "partial.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")

    def write(result) -> None:
        with path.open("a") as f:
            f.write(json.dumps(summarize(result)) + "\n")

    return write


def _plot(args: argparse.Namespace) -> int:
    from agentrt.replay.plots import write_plots

    report = json.loads(Path(args.report).read_text())
    for path in write_plots(report["results"], args.out or Path(args.report).parent):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("gen", help="write synthetic traces (one JSONL file each)")
    _shape_args(gen)
    _model_args(gen)
    gen.add_argument("--out", required=True, help="directory for the trace files")
    run = sub.add_parser("run", help="replay traces against an in-process server per configuration")
    _shape_args(run)
    _model_args(run)
    run.add_argument("--traces", help="a trace file or a directory of them (default: generate with the shape flags)")
    run.add_argument("--configs", default="dense-noprefix,dense-prefix,dense-chain,dense-chain-lag",
                     help="comma-separated: dense-noprefix, dense-prefix, dense-chain, dense-chain-lag, "
                          "snapkv-chain, snapkv-chain-lag")
    run.add_argument("--baseline", default="dense-prefix", help="the configuration speedups are relative to")
    run.add_argument("--snapkv-config", default="{}", help="SnapKV knobs as JSON (e.g. '{\"budget\": 2048}')")
    run.add_argument("--lag", type=int, default=2, help="the lag pruning policy: tool rounds kept whole")
    run.add_argument("--think-scale", type=float, default=1.0, help="multiplies the traces' think times (0: none)")
    run.add_argument("--device", default="auto")
    run.add_argument("--dtype")
    run.add_argument("--load-format", choices=["safetensors", "dummy"])
    run.add_argument("--num-pages", type=int)
    run.add_argument("--max-num-batched-tokens", type=int)
    run.add_argument("--gpu-memory-utilization", type=float)
    run.add_argument("--engine-options", default="{}", help="further EngineConfig fields as JSON")
    run.add_argument("--out", help="directory for replay.json and the plots")
    plot = sub.add_parser("plot", help="the plots of a replay.json written by `run` (e.g. on another machine)")
    plot.add_argument("report", help="a replay.json")
    plot.add_argument("--out", help="directory for the PNGs (default: the report's)")
    args = ap.parse_args(argv)
    try:
        return {"gen": _gen, "run": _run, "plot": _plot}[args.action](args)
    except (TraceError, SynthShapeError) as exc:
        print(f"agentrt replay: {exc}", file=sys.stderr)
        return 2
