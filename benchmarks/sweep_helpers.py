"""What the kernel benchmarks share: the configuration grid, the timer (CUDA-graph replays or eager launches on
a GPU, one wall-clock call in the CPU interpreter's smoke runs), the timing of a list of launch configurations
and the relative difference of two outputs."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

import torch


def save_rows(path: str | None, rows: list) -> None:
    """Write the rows so far to ``path`` (if given) after each one: a run cut by its time limit keeps every
    finished row with all its configurations."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def add_row(path: str | None, rows: list, row: dict) -> None:
    """Append a case's row and save the rows so far (``save_rows``)."""
    rows.append(row)
    save_rows(path, rows)


def report_row(path: str | None, rows: list, row: dict) -> None:
    """A launch sweep's case: its row on stdout (without the per-launch rows), then ``add_row``."""
    print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
    add_row(path, rows, row)


def micros(seconds: float | None) -> str:
    """Seconds as microseconds for a table, "-" for a time not taken (a launch that failed)."""
    return "-" if seconds is None else f"{1e6 * seconds:.1f}"


def finish_rows(path: str | None, rows: list) -> None:
    """The rows as JSON on stdout when no file was asked for."""
    if not path:
        print(json.dumps(rows))


def grid(space: dict) -> list[dict]:
    """Every combination of ``space``'s values, as keyword dicts."""
    configs = [{}]
    for name, values in space.items():
        configs = [{**c, name: v} for c in configs for v in values]
    return configs


def timed(fn: Callable[[], object], on_gpu: bool, graph: bool = True) -> float:
    """Median seconds per call: replayed from a CUDA graph (``graph``: paths that run inside decode graphs,
    no launch overhead) or launched eagerly (paths the engine runs eagerly); on a CPU (the interpreter's
    smoke runs) one wall-clock call after one untimed, only to exercise the code."""
    fn()  # compile outside the capture
    if on_gpu:
        import triton

        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
        return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e-3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timer(tiny: bool) -> Callable[[Callable[[], object]], float]:
    """``timed`` from CUDA-graph replays, or (``tiny``) the CPU's one call."""
    return lambda fn: timed(fn, on_gpu=not tiny, graph=True)


def cycling(fn: Callable[[object], object], operands: list) -> Callable[[], object]:
    """``fn`` over ``operands`` in turn, one a call: with more weight copies than L2 holds, each timed call
    reads its weights from HBM, as a decode step reads each layer's."""
    turn = itertools.cycle(operands)
    return lambda: fn(next(turn))


def sweep_launches(launches: list[dict], check: Callable[[dict], dict], time_launch: Callable[[dict], float]
                   ) -> list[dict]:
    """Each launch: ``check(launch)`` (the fields its output is judged by), then ``time_launch(launch)`` in
    seconds as "s"; a launch that does not compile (registers, shared memory) is recorded with its error."""
    rows = []
    for launch in launches:
        try:
            checked = check(launch)
            seconds = time_launch(launch)
        except Exception as exc:  # noqa: BLE001 -- recorded, not fatal
            rows.append({**launch, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        rows.append({**launch, "s": seconds, **checked})
    return rows


def fastest(launches: list[dict], default: dict, keys) -> dict:
    """``sweep_launches``' summary: the default launch's seconds (None when it did not compile), the fastest
    launch's seconds and its ``keys`` (a key it leaves out: the default's value)."""
    timed = [c for c in launches if "s" in c]
    matching = [c for c in timed if all(c.get(k) == v for k, v in default.items())]
    best = min(timed, key=lambda c: c["s"])
    return {"default_s": matching[0]["s"] if matching else None, "best_s": best["s"],
            "best_launch": {k: best.get(k, default.get(k)) for k in keys}}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def time_configs(run: Callable[..., torch.Tensor], configs: list[dict], measure, work: float, base: torch.Tensor,
                 diff: Callable[[torch.Tensor, torch.Tensor], float]) -> list[dict]:
    """Each launch configuration of ``run``: its output against ``base`` (``diff``), then its time by
    ``measure`` and ``work`` bytes per call in TB/s; a configuration the compiler refuses is recorded."""
    rows = []
    for kw in configs:
        try:
            out = run(**kw)
        except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory: recorded, not fatal
            rows.append({**kw, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        t = measure(lambda kw=kw: run(**kw))
        rows.append({**kw, "ms": t * 1e3, "tb_s": work / t / 1e12, "rel_diff": diff(out, base)})
    return rows
