"""``agentrt eval``: accuracy per method x budget x context length x depth.

Every sample runs through the real engine (`LLMEngine`, greedy) with the method configured for the budget
(`quality.budgets`); an answer counts when the exact answer tokens come out, then the end token. Writes
``results.json`` (grid, lag table, the run's arguments), ``grid.csv``, ``lag.csv``, ``accuracy_vs_budget.png``
and ``depth_length_heatmap.png`` into ``--out``, and prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

from agentrt.config import embedded_model_dir
from engine.cli_args import (CommandLineParser, checkpoint_dir, device, fraction, json_object,
                                    non_negative_ints, positive_int, positive_ints)
from quality.budgets import METHODS, method_config
from quality.multiturn import run_lag, tool_chain
from quality.runner import make_engine, run_samples
from quality.tasks import TASKS, make_sample


def _numbers(low: float, high: float, low_open: bool = False):
    """A type: comma-separated numbers in [low, high] ((low, high] when ``low_open``)."""
    what = f"comma-separated numbers in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or not all((low < v if low_open else low <= v) and v <= high for v in values):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return values

    return parse


def _names(known: tuple[str, ...], what: str):
    """A type: a comma-separated subset of ``known``, or all."""

    def parse(text: str) -> list[str]:
        names = list(known) if text == "all" else [x for x in text.split(",") if x]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or [text]}; known: {', '.join(known)} or all")
        return names

    return parse


def grid_samples(tokenizer, tasks, lengths, depths, samples: int, seed: int) -> dict[tuple[str, int], list]:
    """Seeded samples per (task, length): (requested depth, sample) for every depth x index (the same set for
    every method)."""
    return {(t, n): [(d, make_sample(t, tokenizer, random.Random(f"{seed}-{t}-{n}-{d}-{i}"), n, d))
                     for d in depths for i in range(samples)] for t in tasks for n in lengths}


def run_grid(model, args, engine_options: dict) -> list[dict]:
    """Budgets are sized from each group's mean prompt length (a tool_lookup prompt can exceed its nominal length)."""
    tokenizer = make_engine(model, **engine_options).tokenizer
    groups = grid_samples(tokenizer, args.tasks, args.lengths, args.depths, args.samples, args.seed)
    configs = [("dense", 1.0)] + [(m, b) for m in args.methods if m != "dense" for b in args.budgets]
    rows = []
    for method, budget in configs:
        for (task, length), pairs in groups.items():
            start = time.time()
            samples = [s for _, s in pairs]
            prompt_len = round(sum(len(s.prompt_ids) for s in samples) / len(samples))
            knobs = method_config(method, budget, prompt_len, args.knobs.get(method))
            engine = make_engine(model, method, knobs, **engine_options, num_pages=_pages(samples, 16))
            correct = run_samples(engine, samples)
            cells = defaultdict(list)
            for (depth, _), ok in zip(pairs, correct):
                cells[depth].append(ok)
            for depth, oks in sorted(cells.items()):
                rows.append({"task": task, "method": method, "budget": budget, "length": length, "depth": depth,
                             "prompt_tokens": prompt_len, "n": len(oks), "correct": sum(oks),
                             "accuracy": sum(oks) / len(oks)})
            print(f"[grid] {task} {method} budget={budget:g} length={length}: {sum(correct)}/{len(correct)} "
                  f"({time.time() - start:.0f}s)", file=sys.stderr, flush=True)
    return rows


def _pages(samples: list, concurrent: int, page_size: int = 16) -> int:
    """KV pages for ``concurrent`` of the longest samples at once (an explicit pool: the GPU default would take
    most of the device's memory for every engine)."""
    longest = max(len(s.prompt_ids) + len(s.answer_ids) + 2 for s in samples)
    return (concurrent + 1) * (-(-longest // page_size) + 2)


def run_lag_table(model, args, engine_options: dict) -> list[dict]:
    tokenizer = make_engine(model, **engine_options).tokenizer
    chains = [tool_chain(tokenizer, random.Random(f"{args.seed}-lag-{a}-{i}"), args.rounds, a)
              for a in range(args.rounds) for i in range(args.lag_samples)]
    # every chain keeps its KV between its two turns: the pool holds them all, so none is reclaimed unpruned
    engine = make_engine(model, **engine_options, max_num_seqs=len(chains),
                         num_pages=_pages([c.sample for c in chains], len(chains)))
    configs = [(None, 1.0)] + [(lag, keep) for lag in args.lags for keep in args.keep_ratios]
    rows = []
    for lag, keep in configs:
        correct = run_lag(engine, chains, lag, keep, f"lag{lag}-keep{keep}")
        by_distance = defaultdict(list)
        for c, ok in zip(chains, correct):
            by_distance[c.distance].append(ok)
        for distance, oks in sorted(by_distance.items()):
            rows.append({"lag": lag, "keep_ratio": keep, "distance": distance,
                         "pruned": lag is not None and distance > lag, "n": len(oks), "correct": sum(oks),
                         "accuracy": sum(oks) / len(oks)})
        print(f"[lag] lag={lag} keep={keep}: {sum(correct)}/{len(correct)}", file=sys.stderr, flush=True)
    return rows


def _mean(rows: list[dict]) -> float | None:
    n = sum(r["n"] for r in rows)
    return sum(r["correct"] for r in rows) / n if n else None


def summarize(grid: list[dict], lag: list[dict]) -> dict:
    by_budget = defaultdict(list)
    for r in grid:
        by_budget[(r["task"], r["method"], r["budget"])].append(r)
    lag_summary = defaultdict(dict)
    for key in {(r["lag"], r["keep_ratio"]) for r in lag}:
        rows = [r for r in lag if (r["lag"], r["keep_ratio"]) == key]
        lag_summary[key] = {"recent": _mean([r for r in rows if not r["pruned"]]),
                            "pruned": _mean([r for r in rows if r["pruned"]]), "all": _mean(rows)}
    return {"grid": {f"{t}/{m}/{b:g}": _mean(rs) for (t, m, b), rs in sorted(by_budget.items())},
            "lag": [{"lag": k[0], "keep_ratio": k[1], **v}
                    for k, v in sorted(lag_summary.items(), key=lambda kv: (kv[0][0] is not None, kv[0][0] or 0, kv[0][1]))]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def tables(grid: list[dict], summary: dict, budgets: list[float]) -> str:
    tasks = sorted({r["task"] for r in grid})
    methods = sorted({r["method"] for r in grid}, key=lambda m: (m != "dense", m))
    out = []
    for task in tasks:
        out.append(f"\n{task}: accuracy (%) over lengths and depths\n")
        out.append("| method | " + " | ".join(f"{b:g}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for m in methods:
            cells = [summary["grid"].get(f"{task}/{m}/{1.0 if m == 'dense' else b:g}") for b in budgets]
            out.append(f"| {m} | " + " | ".join(_pct(c) for c in cells) + " |")
    if summary["lag"]:
        out.append("\nlag pruning (tool_lookup chains): accuracy (%) on recent (unpruned) vs pruned asked rounds\n")
        out.append("| lag | keep ratio | recent rounds | pruned rounds | all |")
        out.append("|---|---|---|---|---|")
        for r in summary["lag"]:
            lag = "none" if r["lag"] is None else r["lag"]
            out.append(f"| {lag} | {r['keep_ratio']:g} | {_pct(r['recent'])} | {_pct(r['pruned'])} | {_pct(r['all'])} |")
    return "\n".join(out)


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CommandLineParser(prog="agentrt eval", description=__doc__)
    p.add_argument("--model", type=checkpoint_dir,
                   help="a local Hugging Face checkpoint directory (default: the embedded trained model)")
    p.add_argument("--out", type=Path, default=Path("quality-eval"), help="directory for the results (created)")
    p.add_argument("--tasks", type=_names(TASKS, "task(s)"), default=["needle", "tool_lookup"],
                   help=f"comma list or all ({', '.join(TASKS)})")
    p.add_argument("--methods", type=_names(METHODS, "method(s)"), default=list(METHODS),
                   help=f"comma list or all ({', '.join(METHODS)}) (default: all)")
    p.add_argument("--budgets", type=_numbers(0, 1, low_open=True), default=[0.1, 0.25, 0.5],
                   help="KV budgets as fractions of the prompt")
    p.add_argument("--lengths", type=positive_ints, default=[512, 1024, 2048],
                   help="prompt lengths in tokens (each >= 64 and within the model's context)")
    p.add_argument("--depths", type=_numbers(0, 1), default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="where the asked fact sits, as fractions of the prompt (0: start)")
    p.add_argument("--samples", type=positive_int, default=2, help="samples per task x length x depth")
    p.add_argument("--knobs", type=json_object, default={},
                   help='per-method knob overrides as JSON, e.g. \'{"snapkv": {"kernel_size": 7}}\' (default: none)')
    p.add_argument("--heatmap-budget", type=fraction, default=0.25, help="the budget the depth x length heatmap shows")
    p.add_argument("--rounds", type=int, default=6, help="tool rounds per lag-test chain (>= 2)")
    p.add_argument("--lags", type=non_negative_ints, default=[1, 2, 4],
                   help="lag pruning policies to test (tool rounds kept whole)")
    p.add_argument("--keep-ratios", type=_numbers(0, 1), default=[0.0, 0.2, 0.5],
                   help="fractions of a pruned tool result kept")
    p.add_argument("--lag-samples", type=positive_int, default=4, help="chains per asked round")
    p.add_argument("--no-lag", action="store_true", help="skip the lag-pruning table")
    p.add_argument("--device", type=device, default="cpu", help="auto (a GPU when visible), cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype (auto: the checkpoint's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f"argument --rounds: expected an integer >= 2, got {args.rounds}")
    unknown = sorted(set(args.knobs) - set(METHODS))
    if unknown or not all(isinstance(v, dict) for v in args.knobs.values()):
        p.error(f"argument --knobs: expected {{method: {{knob: value}}}} for methods among {', '.join(METHODS)}, "
                f"got {json.dumps(args.knobs)}")
    if min(args.lengths) < 64:
        p.error(f"argument --lengths: each length must be >= 64 tokens, got {min(args.lengths)}")
    context = json.loads((Path(args.model or embedded_model_dir()) / "config.json").read_text()).get(
        "max_position_embeddings")
    if context and max(args.lengths) + 64 > context:  # the prompt (within a filler sentence) and its answer
        p.error(f"argument --lengths: {max(args.lengths)} does not fit the model's context of {context} tokens "
                f"with the answer; use lengths up to {context - 64}")
    return args


def _plot(grid: list[dict], summary: dict, args) -> None:
    try:
        from quality.plots import accuracy_vs_budget, depth_length_heatmap
        dense = {t: summary["grid"][f"{t}/dense/1"] for t in args.tasks}
        accuracy_vs_budget(grid, dense, args.out / "accuracy_vs_budget.png")
        depth_length_heatmap(grid, args.tasks[0], args.heatmap_budget, args.out / "depth_length_heatmap.png")
    except ImportError as exc:
        print(f"no plots ({exc}); pip install 'agentrt[quality]'", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or str(embedded_model_dir())
    engine_options = {"device": args.device, "dtype": args.dtype}
    start = time.time()
    grid = run_grid(model, args, engine_options)
    args.out.mkdir(parents=True, exist_ok=True)
    _write_csv(args.out / "grid.csv", grid)  # kept if the lag stage fails
    lag = [] if args.no_lag else run_lag_table(model, args, engine_options)
    summary = summarize(grid, lag)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m quality.eval " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": str(model), "seconds": round(time.time() - start, 1),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "summary": summary, "grid": grid, "lag": lag}
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    _write_csv(args.out / "grid.csv", grid)
    _write_csv(args.out / "lag.csv", lag)
    _plot(grid, summary, args)
    print(json.dumps({"seconds": record["seconds"], "summary": summary}))
    print(tables(grid, summary, sorted(set(args.budgets) | {1.0})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
