"""Where an agent replay's engine steps spend their time, by step kind: a window of one configuration's steps under
torch.profiler.

    python -m benchmarks.replay_profile --first-step 400 --steps 80 --json prof.json -- \\
        --shape llama-3.1-8b --load-format dummy --sessions 24 --turns 12,12 --num-pages 6000 --think-scale 1 \\
        --max-num-batched-tokens 8192 --configs snapkv-chain-tiers --snapkv-config '{"budget": 4096}'

Runs ``agentrt replay run`` with the arguments after ``--`` in this process, with ``LLMEngine.step`` wrapped:
engine steps ``first-step .. first-step + steps - 1`` (``LLMEngine.step`` calls, counted from the timed run's first,
the configuration's warm-up before it not counted; a call may run several decode steps, ``EngineConfig.decode_steps``;
give one configuration, and a window that ends inside the run: the profile begins and ends in the engine's thread)
run under torch.profiler, host and device. Per step kind (``StepTiming.kind``: decode-graph, decode-eager, mixed,
prefill; a step that only launched an overlapped decode window has none): how many, the
median wall time, the device's busy time (the union of its kernel and copy intervals) and so its idle time, the
engine's phases, and the longest idle gaps with the host operation running at each one's start
(``benchmarks.profile_decode``); for each kind the GPU time per step by kernel, and the host operations by
self time over the window. A kind whose wall time far exceeds its busy time is host-bound: its gaps say where.

What the replay's step table (``agentrt replay run``) gives as wall seconds by kind, this splits into device work
and the host's gaps; the profiler's own overhead (host side) lengthens the profiled steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_decode import PHASES, device_timeline
from engine.llm_engine import LLMEngine


class StepWindow:
    """Wraps ``LLMEngine.step`` (the class's, so the engine the replay builds uses it): steps ``first`` ..
    ``first + count - 1`` of the timed run (counted from its start: ``Replayer.run`` of the traces themselves, not
    of the warm-up trace) run under one profiler, entered and left in the engine's thread."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self.seen = 0
        self.prof = None
        self.running = False
        self.steps: list[dict] = []  # per profiled step: kind, wall_ms, phases
        self._original = LLMEngine.step

    def __enter__(self) -> StepWindow:
        window, original = self, self._original

        def step(engine: LLMEngine):
            index = window.seen
            window.seen += 1
            if not window.first <= index < window.first + window.count:
                return original(engine)
            if index == window.first:
                window.prof = profile(activities=_activities())
                window.prof.__enter__()
                window.running = True
            t = time.perf_counter()
            with torch.profiler.record_function("engine.step"):
                out = original(engine)
            wall = time.perf_counter() - t
            timing = engine.last_step
            window.steps.append({"kind": None if timing is None else timing.kind, "wall_ms": 1e3 * wall,
                                 **{f"{k}_ms": 0.0 if timing is None else 1e3 * getattr(timing, f"{k}_s")
                                    for k in PHASES}})
            if index == window.first + window.count - 1:
                window.stop(engine)
            return out

        LLMEngine.step = step
        from agentrt.replay.bench import WARM_UP_MARK
        from agentrt.replay.replayer import Replayer

        replay = self._replay = Replayer.run

        async def run(replayer: Replayer, traces, config):
            if not traces[0].header.system_prompt.startswith(WARM_UP_MARK):
                window.seen = 0  # the timed run starts: its steps are counted, the warm-ups' before it are not
            return await replay(replayer, traces, config)

        Replayer.run = run
        return self

    def stop(self, engine: LLMEngine) -> None:
        """End the profile after the window's last step, in the engine's thread (where it began)."""
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.running = False

    def __exit__(self, *exc) -> None:
        from agentrt.replay.replayer import Replayer

        LLMEngine.step = self._original
        Replayer.run = self._replay

    def report(self, top: int = 15) -> dict:
        """Per kind: steps, medians of wall / busy / phases, the largest gaps, device ms per step by kernel;
        host ops by self time over the window."""
        if self.prof is None or self.running:  # the run ended before the window began, or inside it
            return {"profiled_steps": 0, "steps_seen": self.seen,
                    "error": f"the replay ran {self.seen} engine steps: the window [{self.first}, "
                             f"{self.first + self.count}) must end inside the run"}
        events = self.prof.events()
        windows = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "engine.step")
        phases = [{k: s[f"{k}_ms"] for k in PHASES} for s in self.steps]
        timeline = device_timeline(self.prof, windows, phases)
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        by_kind: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.steps[:len(windows)]):
            by_kind[s["kind"] or "window-launch"].append(i)
        kinds = {}
        for kind, idx in by_kind.items():
            kernels: dict[str, float] = defaultdict(float)
            for i in idx:
                lo, hi = windows[i]
                for e in device:
                    if lo <= e.time_range.start < hi:
                        kernels[e.name[:90]] += e.time_range.end - e.time_range.start
            gaps = sorted((g for i in idx for g in timeline[i]["gaps"]), key=lambda g: g["idle_us"], reverse=True)
            kinds[kind] = {
                "steps": len(idx),
                "median_wall_ms": round(statistics.median(self.steps[i]["wall_ms"] for i in idx), 3),
                "median_busy_ms": round(statistics.median(timeline[i]["busy_us"] for i in idx) / 1e3, 3),
                **{f"median_{k}_ms": round(statistics.median(self.steps[i][f"{k}_ms"] for i in idx), 3)
                   for k in PHASES},
                "largest_gaps": gaps[:8],
                "device_ms_per_step": {name: round(us / 1e3 / len(idx), 4) for name, us in
                                       sorted(kernels.items(), key=lambda kv: kv[1], reverse=True)[:top]},
            }
        host = sorted(self.prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
        return {"profiled_steps": len(windows), "steps_seen": self.seen, "kinds": kinds,
                "host_self_ms": {a.key: round(a.self_cpu_time_total / 1e3, 3) for a in host}}


def _activities() -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def print_table(report: dict) -> None:
    print(report.get("error") or f"profiled {report['profiled_steps']} of {report['steps_seen']} engine steps")
    print("kind            steps  wall ms  busy ms  idle ms  schedule  prepare  execute  update  largest gap (host op)")
    for kind, r in report.get("kinds", {}).items():
        gap = r["largest_gaps"][0] if r["largest_gaps"] else {"idle_us": 0, "host_op": None}
        print(f"{kind:15s} {r['steps']:5d} {r['median_wall_ms']:8.2f} {r['median_busy_ms']:8.2f} "
              f"{r['median_wall_ms'] - r['median_busy_ms']:8.2f} {r['median_schedule_ms']:9.2f} "
              f"{r['median_prepare_ms']:8.2f} {r['median_execute_ms']:8.2f} {r['median_update_ms']:7.2f}  "
              f"{gap['idle_us'] / 1e3:.2f} ms ({gap['host_op']})")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first-step", type=int, default=200, help="the first profiled engine step (0-based)")
    ap.add_argument("--steps", type=int, default=60, help="how many engine steps to profile")
    ap.add_argument("--json")
    ap.add_argument("replay_args", nargs=argparse.REMAINDER, help="-- then `agentrt replay run`'s arguments")
    args = ap.parse_args(argv)
    replay_args = args.replay_args[1:] if args.replay_args[:1] == ["--"] else args.replay_args
    from agentrt.replay.cli import main as replay_main

    window = StepWindow(args.first_step, args.steps)
    with window:
        rc = replay_main(["run", *replay_args])
    report = {"replay_rc": rc, **window.report()}
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
