"""Where a decode step's time goes: the kernels of one graph replay, and the device's idle time across whole
engine steps.

    python benchmarks/profile_decode.py --shape llama-3.1-8b --batch 1 --context 4096
    python benchmarks/profile_decode.py --shape qwen3-30b-a3b --batch 32 --context 4096 --steps 8 --json out.json

Without ``--steps``: torch.profiler over 5 replays of the batch's decode CUDA graph (GPU time per kernel).
With ``--steps N``: N full ``engine.step()`` calls of the decoding batch under torch.profiler (host and device
activities). Per step it reports the wall time, the engine's phases (schedule / prepare / execute / update),
the device's busy time (the union of its kernel and copy intervals) and so its idle time, and the longest idle
gaps with the engine phase and host operation running when each began; then the GPU time per step by
kernel (what a real step's graph spends, its routing included) and the host operations by self time. A step
whose wall time far exceeds its busy time is host-bound: the gaps say where the host was.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.throughput import write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


PHASES = ("schedule", "prepare", "execute", "update")


def _phase_at(offset_us: float, phases: dict[str, float]) -> str:
    """The engine phase running ``offset_us`` after the step began (phases: ms, in order)."""
    edge = 0.0
    for name in PHASES:
        edge += 1e3 * phases[name]
        if offset_us < edge:
            return name
    return "after"


def device_timeline(prof, windows: list[tuple[float, float]], phases: list[dict[str, float]]) -> list[dict]:
    """Per host window (us, profiler clock): device busy us and the largest idle gaps inside it, each with the
    engine phase and the innermost host op running at the gap's start."""
    events = prof.events()
    device = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    out = []
    for (lo, hi), step_phases in zip(windows, phases):
        spans = [(max(a, lo), min(b, hi)) for a, b in device if b > lo and a < hi]
        gaps, cursor = [], lo
        for a, b in sorted(spans):
            if a > cursor:
                gaps.append((a - cursor, cursor))
            cursor = max(cursor, b)
        if hi > cursor:
            gaps.append((hi - cursor, cursor))
        top = []
        for length, start in sorted(gaps, reverse=True)[:4]:
            running = [e for e in host if e.time_range.start <= start < e.time_range.end]
            inner = min(running, key=lambda e: e.time_range.end - e.time_range.start, default=None)
            top.append({"idle_us": round(length, 1), "phase": _phase_at(start - lo, step_phases),
                        "host_op": inner.name if inner is not None else None})
        out.append({"busy_us": round(_union(spans), 1), "window_us": round(hi - lo, 1), "gaps": top})
    return out


def device_ops(prof, steps: int, top: int = 20) -> dict[str, float]:
    """Device time per step by kernel / copy name (the kernels inside replayed graphs included), largest first."""
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    ranked = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {name[:90]: round(us / 1e3 / steps, 4) for name, us in ranked}


def make_engine(args, model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, load_format="dummy", max_num_seqs=args.batch,
                                  max_model_len=args.context + 64 + 8 * args.steps, enable_prefix_caching=False,
                                  num_pages=args.batch * ((args.context + 8 * args.steps) // 16 + 16),
                                  max_num_batched_tokens=16384, decode_steps=args.decode_steps,
                                  device=args.device, dtype=args.dtype))


def profile_steps(engine: LLMEngine, steps: int) -> dict:
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    walls, phases = [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            with torch.profiler.record_function("engine.step"):
                engine.step()
            walls.append(time.perf_counter() - t)
            timing = engine.last_step  # None: the step only launched an overlapped window
            phases.append({k: 0.0 if timing is None else 1e3 * getattr(timing, f"{k}_s") for k in PHASES})
        sync()
    windows = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "engine.step")
    per_step = device_timeline(prof, windows, phases)
    for row, wall, ph in zip(per_step, walls, phases):
        row.update(wall_ms=round(1e3 * wall, 3), **{f"{k}_ms": round(v, 3) for k, v in ph.items()})
    host = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    return {"steps": per_step, "device_ms_per_step": device_ops(prof, steps),
            "median_wall_ms": statistics.median(walls) * 1e3,
            "median_busy_ms": statistics.median(r["busy_us"] for r in per_step) / 1e3,
            "host_self_ms_per_step": {a.key: round(a.self_cpu_time_total / 1e3 / steps, 3) for a in host}}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=0, help="profile this many whole engine steps instead of replays")
    ap.add_argument("--decode-steps", type=int, default=1, help="EngineConfig.decode_steps")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(args, write_shape_dir(args.shape, Path(tmp)))
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size
        for _ in range(args.batch):
            engine.add_request([rng.randrange(vocab) for _ in range(args.context)],
                               SamplingParams(temperature=0.0, max_tokens=16 + 8 * args.steps * args.decode_steps,
                                              ignore_eos=True))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine._requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()
        if args.steps:
            result = profile_steps(engine, args.steps)
            print(f"{'step':>4} {'wall ms':>9} {'busy ms':>9} {'sched':>7} {'prep':>7} {'exec':>7} {'upd':>7}  "
                  "largest idle gaps (us, phase / host op at their start)")
            for i, r in enumerate(result["steps"]):
                gaps = ", ".join(f"{g['idle_us']:.0f} {g['phase']}/{g['host_op']}" for g in r["gaps"])
                print(f"{i:>4} {r['wall_ms']:>9.3f} {r['busy_us'] / 1e3:>9.3f} {r['schedule_ms']:>7.3f} "
                      f"{r['prepare_ms']:>7.3f} {r['execute_ms']:>7.3f} {r['update_ms']:>7.3f}  {gaps}")
            print("GPU time by kernel (ms per step):")
            for name, ms in result["device_ms_per_step"].items():
                print(f"  {ms:>8.3f}  {name}")
            print("host ops by self time (ms per step):")
            for name, ms in result["host_self_ms_per_step"].items():
                print(f"  {ms:>8.3f}  {name}")
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
            return result
        graph = engine.runner.graphs.graphs[engine.runner.graphs.bucket_for(args.batch)]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    return None


if __name__ == "__main__":
    main()
