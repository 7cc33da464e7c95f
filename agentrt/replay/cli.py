"""``agentrt replay``: generate synthetic traces, and replay traces against in-process servers.

    agentrt replay gen --out traces/ --num 16 --seed 0                       # the issue's shape (30-50 turns)
    agentrt replay run --traces traces/ --configs dense-prefix,dense-chain,dense-chain-lag --out results/
    agentrt replay run --sessions 4 --turns 8,8 --device cpu --out /tmp/replay   # generate inline
    agentrt replay run --shape llama-3.1-8b --load-format dummy --sessions 16 --turns 30,30 ...  # GPU
    agentrt replay plot results/replay.json                                  # the PNGs of a report
    agentrt replay report a/partial.jsonl b/partial.jsonl --baseline dense-prefix   # runs joined in one table

Generated traces must fit the model's context (max_model_len): with none of the token flags given, the
coding-agent shape's system prompt, task and tool results are scaled down by one factor until each trace
fits (turns and assistant outputs are kept); with any of them given, a trace that does not fit is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from agentrt.replay.bench import standard_configs
from agentrt.replay.synth import SynthShape, SynthShapeError, fit_trace, synth_traces
from agentrt.replay.trace import Trace, TraceError, load, write_many
from benchmarks.model_shapes import SHAPES
from engine.cli_args import (CommandLineParser, checked_after_parsing, checkpoint_dir, device, fraction,
                                    json_object, non_negative_float, non_negative_int, positive_int, usage_error)

CONFIG_NAMES = tuple(standard_configs())
SIZE_FLAGS = {"system_tokens": "--system-tokens", "task_tokens": "--task-tokens", "tool_tokens": "--tool-tokens",
              "output_tokens": "--output-tokens"}
SHAPE_FLAGS = {"num_turns": "--turns", **SIZE_FLAGS, "think_time_s": "--think-time"}
ENGINE_FLAGS = {"device": "--device", "dtype": "--dtype", "load_format": "--load-format", "num_pages": "--num-pages",
                "max_num_batched_tokens": "--max-num-batched-tokens",
                "gpu_memory_utilization": "--gpu-memory-utilization"}


class Mistake(Exception):
    """A usage mistake found after parsing: the message names the flag."""


def _range(kind: type = int):
    what = "integers" if kind is int else "numbers"

    def parse(text: str) -> tuple[Any, Any]:
        try:
            parts = [kind(p) for p in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (1, 2) or not 0 <= parts[0] <= parts[-1]:
            raise argparse.ArgumentTypeError(f"expected LO,HI (0 <= LO <= HI) or N, {what}, got {text!r}")
        return (parts[0], parts[-1])

    return parse


def _configs(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown or [text]}; known: "
                                         f"{', '.join(CONFIG_NAMES)}")
    return names


def _exists(text: str) -> None:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")


@checked_after_parsing(_exists)
def _existing(text: str) -> str:
    return text


def _shape_args(p: argparse.ArgumentParser) -> None:
    d = SynthShape()
    fits = "scaled down with the others to fit the model"
    p.add_argument("--num", "--sessions", dest="num", type=positive_int, default=16,
                   help="traces (= concurrent sessions)")
    p.add_argument("--seed", type=int, default=0, help="trace i uses seed + i")
    p.add_argument("--turns", type=_range(), default=d.num_turns, help="LO,HI turns per trace")
    p.add_argument("--system-tokens", type=positive_int, help=f"system prompt tokens (default: {d.system_tokens}, {fits})")
    p.add_argument("--task-tokens", type=_range(),
                   help="LO,HI tokens of the user's task (default: {},{}, {})".format(*d.task_tokens, fits))
    p.add_argument("--tool-tokens", type=_range(),
                   help="LO,HI tokens of a tool result (default: {},{}, {})".format(*d.tool_tokens, fits))
    p.add_argument("--output-tokens", type=_range(),
                   help="LO,HI recorded assistant tokens (default: {},{})".format(*d.output_tokens))
    p.add_argument("--think-time", type=_range(float), default=d.think_time_s,
                   help="LO,HI seconds the agent pauses after a turn")


def _model_args(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", type=checkpoint_dir,
                       help="a local Hugging Face checkpoint directory (default: the embedded tiny model)")
    which.add_argument("--shape", choices=sorted(SHAPES), metavar="SHAPE",
                       help=f"a named model shape with the project tokenizer ({', '.join(sorted(SHAPES))}); "
                            "weights: --load-format dummy")


def _model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.shape:
        from benchmarks.throughput import write_shape_dir

        return write_shape_dir(args.shape, tmp)
    if args.model:
        return Path(args.model)
    from engine.tiny_checkpoint import embedded_model_dir

    return embedded_model_dir()


def _synth_shape(args: argparse.Namespace) -> SynthShape:
    given = {"num_turns": args.turns, "think_time_s": args.think_time}
    given.update({field: getattr(args, field) for field in SIZE_FLAGS if getattr(args, field) is not None})
    try:
        return SynthShape(**given)
    except SynthShapeError as exc:
        raise Mistake(f"{SHAPE_FLAGS.get(exc.field, '--turns')}: {exc}") from None


def _max_model_len(model_dir: Path, engine_options: dict[str, Any]) -> int:
    from engine.model_config import ModelConfig

    limit = ModelConfig.from_dir(model_dir).max_position_embeddings
    return min(engine_options.get("max_model_len") or limit, limit)


def _renderer(model_dir: Path):
    from agentrt.chat import ChatRenderer
    from engine.llm_engine import load_tokenizer

    return ChatRenderer(load_tokenizer(model_dir), [])


def _generate(args: argparse.Namespace, model_dir: Path, max_model_len: int) -> list[Trace]:
    """Traces of the shape the flags give, each fitting ``max_model_len`` (see the module's docstring)."""
    from agentrt.replay.replayer import context_tokens

    shape = _synth_shape(args)  # checked before the model: see main
    renderer = _renderer(model_dir)
    tokenizer = renderer.tokenizer
    config_vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", len(tokenizer))
    kw = {"tokenizer_name": model_dir.name, "vocab_size": min(len(tokenizer), int(config_vocab))}  # ids of both
    count = lambda trace: context_tokens(renderer, trace)  # noqa: E731
    if all(getattr(args, field) is None for field in SIZE_FLAGS):
        try:
            traces = [fit_trace(tokenizer, args.seed + i, shape, max_model_len, count, **kw) for i in range(args.num)]
        except SynthShapeError as exc:
            raise Mistake(f"--turns {args.turns[0]},{args.turns[1]}: {exc} (max_model_len): lower --turns, or use "
                          "a model with a longer context (--model, --shape)") from None
        scales = [t.header.metadata.get("scale", 1.0) for t in traces]
        if min(scales) < 1.0:
            print(f"agentrt replay: system prompts, tasks and tool results scaled by {min(scales):.2g} to "
                  f"{max(scales):.2g} to fit the model's max_model_len {max_model_len}", file=sys.stderr)
        return traces
    traces = synth_traces(tokenizer, args.num, args.seed, shape, **kw)
    for trace in traces:
        if (n := count(trace)) > max_model_len:
            given = [flag for field, flag in SIZE_FLAGS.items() if getattr(args, field) is not None]
            raise Mistake(f"{', '.join(given)}: trace {trace.header.trace_id} of {trace.num_turns} turns takes "
                          f"{n} tokens but the model holds {max_model_len} (max_model_len): lower --turns or the "
                          "token flags, or leave the token flags out to scale the traces to fit")
    return traces


def _check_recorded(traces: list[Trace], source: str, model_dir: Path, max_model_len: int) -> None:
    from agentrt.replay.replayer import context_tokens
    from engine.model_config import ModelConfig

    renderer = _renderer(model_dir)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    for trace in traces:
        if max(max(t.output_token_ids) for t in trace.turns) >= vocab:
            raise Mistake(f"--traces {source}: trace {trace.header.trace_id} forces token ids outside the model's "
                          f"vocabulary ({vocab}): its tokenizer is {trace.header.tokenizer!r}; replay it on that "
                          "model (--model, --shape)")
        if (n := context_tokens(renderer, trace)) > max_model_len:
            raise Mistake(f"--traces {source}: trace {trace.header.trace_id} takes {n} tokens by its last turn but "
                          f"the model holds {max_model_len} (max_model_len): replay it on a model with a longer "
                          "context (--model, --shape)")


def _gen(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="agentrt-shape-") as tmp:
        model_dir = _model_dir(args, Path(tmp))
        traces = _generate(args, model_dir, _max_model_len(model_dir, {}))
    for path in write_many(traces, args.out):
        print(path)
    return 0


def _engine_options(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    options: dict[str, Any] = {"device": args.device, "max_num_seqs": max(64, args.num), **args.engine_options}
    for key in ENGINE_FLAGS:
        if key != "device" and getattr(args, key) is not None:
            options[key] = getattr(args, key)
    try:
        EngineConfig.from_kwargs(model_dir, **options)
    except ConfigError as exc:
        flag = next((f for k, f in ENGINE_FLAGS.items()
                     if str(exc).startswith(k) and k not in args.engine_options), "--engine-options")
        raise Mistake(f"{flag}: {exc}") from None
    return options


def _run(args: argparse.Namespace) -> int:
    from agentrt.replay.bench import run_all
    from agentrt.replay.report import median_of_runs, steps_table, summarize, table, with_speedups
    from engine.errors import ConfigError
    from engine.registry import create_method

    if any(n.startswith("snapkv") for n in args.configs):
        try:
            create_method("snapkv", args.snapkv_config)
        except ConfigError as exc:
            raise Mistake(f"--snapkv-config: {exc}") from None
    known = standard_configs(args.snapkv_config, {"lag": args.lag})
    with tempfile.TemporaryDirectory(prefix="agentrt-shape-") as tmp:
        model_dir = _model_dir(args, Path(tmp))
        engine_options = _engine_options(args, model_dir)
        max_model_len = _max_model_len(model_dir, engine_options)
        if args.traces:
            files = sorted(Path(args.traces).glob("*.jsonl")) if Path(args.traces).is_dir() else [Path(args.traces)]
            if not files:
                raise Mistake(f"--traces {args.traces}: no *.jsonl trace files in it")
            traces = [load(f) for f in files][: args.num]
            _check_recorded(traces, args.traces, model_dir, max_model_len)
        else:
            traces = _generate(args, model_dir, max_model_len)
        log = (lambda m: print(m, file=sys.stderr, flush=True))
        runs = run_all(traces, [known[n] for n in args.configs], log, on_result=_partial_writer(args.out),
                       model=model_dir, engine_options=engine_options, think_scale=args.think_scale,
                       repeats=args.repeats)
    summaries = with_speedups(median_of_runs([summarize(r) for r in runs]), args.baseline)
    report = {"model": args.shape or args.model or "embedded tiny", "engine_options": engine_options,
              "sessions": len(traces), "turns_per_session": [t.num_turns for t in traces],
              "trace_scale": [t.header.metadata.get("scale", 1.0) for t in traces],
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

    try:
        report = json.loads(Path(args.report).read_text())
        results = report["results"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise Mistake(f"{args.report}: not a replay.json written by `agentrt replay run`") from None
    for path in write_plots(results, args.out or Path(args.report).parent):
        print(path)
    return 0


def _report(args: argparse.Namespace) -> int:
    """One table from the summaries of several runs (``partial.jsonl`` or ``replay.json``), e.g. one configuration a
    run on the same machine, speedups against ``--baseline``."""
    from agentrt.replay.report import median_of_runs, steps_table, table, with_speedups

    summaries = []
    for name in args.runs:
        if not Path(name).is_file():
            raise Mistake(f"{name} does not exist")
        text = Path(name).read_text()
        try:
            found = (json.loads(text)["results"] if name.endswith(".json")
                     else [json.loads(line) for line in text.splitlines() if line.strip()])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise Mistake(f"{name}: not a replay.json or partial.jsonl written by `agentrt replay run`") from None
        summaries.extend(found)
    if not any(s.get("config") == args.baseline for s in summaries):
        raise Mistake(f"--baseline: no run of {args.baseline!r} in {', '.join(args.runs)}")
    try:
        summaries = with_speedups(median_of_runs(summaries), args.baseline)
    except ValueError as exc:
        raise Mistake(str(exc)) from None
    print(json.dumps({"results": summaries}, indent=1))
    print(table(summaries))
    print("\nengine steps by kind (count / wall s):")
    print(steps_table(summaries))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = CommandLineParser(prog="agentrt replay", description=__doc__)
    sub = ap.add_subparsers(dest="action", required=True, metavar="ACTION")
    gen = sub.add_parser("gen", help="write synthetic traces (one JSONL file each)",
                         description="Write synthetic coding-agent traces, one JSONL file each (docs/sdk.md).")
    _shape_args(gen)
    _model_args(gen)
    gen.add_argument("--out", required=True, help="directory for the trace files")
    run = sub.add_parser("run", help="replay traces against an in-process server per configuration",
                         description="Replay traces against an in-process server per configuration; prints a\n"
                                     "JSON report and a table (docs/benchmarks.md).")
    _shape_args(run)
    _model_args(run)
    run.add_argument("--traces", type=_existing,
                     help="a trace file or a directory of them (default: generate with the shape flags)")
    run.add_argument("--configs", type=_configs, default=list(CONFIG_NAMES[:4]),
                     help=f"comma-separated: {', '.join(CONFIG_NAMES)}")
    run.add_argument("--baseline", default="dense-prefix", choices=CONFIG_NAMES, metavar="CONFIG",
                     help="the configuration speedups are relative to")
    run.add_argument("--snapkv-config", type=json_object, default="{}",
                     help="SnapKV knobs as JSON (e.g. '{\"budget\": 2048}')")
    run.add_argument("--lag", type=non_negative_int, default=2, help="the lag pruning policy: tool rounds kept whole")
    run.add_argument("--repeats", type=positive_int, default=1,
                     help="runs of every configuration (rounds of all of them); the table gives medians [min-max]")
    run.add_argument("--think-scale", type=non_negative_float, default=1.0,
                     help="multiplies the traces' think times (0: none)")
    run.add_argument("--device", type=device, default="auto", help="auto (a GPU when visible), cpu or cuda[:N]")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weights and KV dtype (default: the checkpoint's)")
    run.add_argument("--load-format", choices=["safetensors", "dummy"],
                     help="dummy: seeded random weights, e.g. for --shape (default: safetensors)")
    run.add_argument("--num-pages", type=positive_int, help="KV pool size in pages (default: the engine's)")
    run.add_argument("--max-num-batched-tokens", type=positive_int,
                     help="token budget of one engine step (default: the engine's)")
    run.add_argument("--gpu-memory-utilization", type=fraction,
                     help="fraction of GPU memory the engine may use (default: the engine's)")
    run.add_argument("--engine-options", type=json_object, default="{}", help="further EngineConfig fields as JSON")
    run.add_argument("--out", help="directory for replay.json and the plots")
    plot = sub.add_parser("plot", help="the plots of a replay.json written by `run` (e.g. on another machine)",
                          description="The PNGs of a replay.json written by `agentrt replay run`.")
    plot.add_argument("report", type=_existing, help="a replay.json")
    plot.add_argument("--out", help="directory for the PNGs (default: the report's)")
    report = sub.add_parser("report", help="one table from several runs' summaries (partial.jsonl / replay.json)",
                            description="One table, with speedups against --baseline, from the summaries several "
                                        "`agentrt replay run`s wrote\n(e.g. one configuration a run, each under a "
                                        "time limit, on the same machine); a configuration\nfound in several "
                                        "summaries is reported as the median of its runs [min-max].")
    report.add_argument("runs", nargs="+", help="partial.jsonl or replay.json files")
    report.add_argument("--baseline", default="dense-prefix", metavar="CONFIG",
                        help="the configuration speedups are relative to")
    return ap


def main(argv: list[str] | None = None) -> int:
    from engine.errors import CheckpointError, EngineError
    from sdk.errors import AgentrtError

    args = build_parser().parse_args(argv)
    prog = f"agentrt replay {args.action}"
    try:
        if args.action in ("gen", "run"):
            _synth_shape(args)  # a bad shape fails before the model and tokenizer load
        return {"gen": _gen, "run": _run, "plot": _plot, "report": _report}[args.action](args)
    except (Mistake, TraceError) as exc:
        return usage_error(prog, exc)
    except CheckpointError as exc:
        return usage_error(prog, f"{'--shape' if getattr(args, 'shape', None) else '--model'}: {exc}")
    except EngineError as exc:
        return usage_error(prog, exc)
    except AgentrtError as exc:
        if exc.status_code is None or not 400 <= exc.status_code < 500:
            raise
        return usage_error(prog, f"the server refused a turn: {exc}")
