"""Where a SnapKV chain turn's time goes: its prompt's prefill attention, SnapKV's vote and its compaction.

    python -m benchmarks.chain_turn_profile --shape llama-3.1-8b --history 16384 --new-tokens 2048
    python -m benchmarks.chain_turn_profile --shape tiny --history 300 --new-tokens 60 --budget 64 --window 8

A chain is built with one turn of ``--history`` prompt tokens (random ids; SnapKV compacts it to ``--budget`` at
the prompt's end), then its next turn appends ``--new-tokens`` and runs under torch.profiler until its first
token: the chain's retained KV resumes, the turn recomputes SnapKV's observation window, prefills its new tokens
in chunks of ``--max-num-batched-tokens`` (mixed with nothing else), votes with the window's queries over every
slot each layer holds and compacts back to the budget. Reported (one turn; ``--repeats`` turns on fresh chains,
medians): the turn's wall time, and the GPU kernels' time (on a CPU: host time) under SnapKV's named ranges
``snapkv.vote`` and ``snapkv.compact`` (``policies/snapkv.py``), in attention kernels (prefill / paged attention
by name) and in everything else.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.chain_resume import run_to_end
from benchmarks.throughput import write_shape_dir
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

RANGES = ("snapkv.vote", "snapkv.compact")
ATTENTION = re.compile(r"prefill|attention|attn|fmha|flash", re.IGNORECASE)


def _range_kernels(event) -> list:
    """The kernels launched inside a host-side event and everything under it."""
    kernels, stack = [], [event]
    while stack:
        e = stack.pop()
        kernels.extend(e.kernels)
        stack.extend(e.cpu_children)
    return kernels


def split_kernel_time(events, on_gpu: bool) -> dict[str, float]:
    """Milliseconds of GPU kernel time (on a CPU: the ranges' host time, no kernels) under SnapKV's two ranges,
    in attention kernels outside them, and in every other kernel; and the host's time inside each range. A
    range's kernels are read from its host-side event (those its ops launched, Triton's included: they are
    linked to the innermost range open at launch), not from ``key_averages``, which folds the range's span on
    the GPU timeline (gaps where the GPU waits for the host included) into the same name; the totals come from
    the GPU-side kernel events."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ranges = {name: 0.0 for name in RANGES}
    host = {name: 0.0 for name in RANGES}
    attention_in_ranges = 0.0
    for e in events:
        if e.name in ranges and e.device_type == cpu:
            kernels = _range_kernels(e)
            ranges[e.name] += sum(k.duration for k in kernels) if on_gpu else e.cpu_time_total
            host[e.name] += e.cpu_time_total
            attention_in_ranges += sum(k.duration for k in kernels if ATTENTION.search(k.name))
    total = attention = 0.0
    for e in events:
        if e.device_type == gpu and e.name not in ranges:  # kernels and copies; a range's GPU span is skipped
            total += e.device_time_total
            attention += e.device_time_total if ATTENTION.search(e.name) else 0.0
    attention -= attention_in_ranges
    other = total - sum(ranges.values()) - attention if on_gpu else 0.0
    return {"vote_ms": ranges["snapkv.vote"] / 1e3, "compact_ms": ranges["snapkv.compact"] / 1e3,
            "attention_ms": attention / 1e3, "other_ms": max(0.0, other) / 1e3,
            # the host's time inside each range: above its kernel time, the GPU waited for the host there
            "vote_host_ms": host["snapkv.vote"] / 1e3, "compact_host_ms": host["snapkv.compact"] / 1e3}


def run_until_first_token(engine: LLMEngine, rid: str) -> None:
    while True:
        outs = engine.step()
        if any(o.request_id == rid and (o.token_ids or o.finished) for o in outs):
            return


def one_turn(engine: LLMEngine, args, seed: int, on_gpu: bool) -> dict:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    chain = f"c{seed}"
    first = [rng.randrange(3, vocab) for _ in range(args.history)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = run_to_end(engine, engine.add_request(first, params, chain_id=chain))
    prompt = first + out.token_ids + [rng.randrange(3, vocab) for _ in range(args.new_tokens)]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params, chain_id=chain)
        run_until_first_token(engine, rid)
        sync()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    info = engine.chain_info(chain)
    split = split_kernel_time(prof.events(), on_gpu)
    return {"wall_ms": 1e3 * wall, **split, "chain_logical_tokens": info.logical_tokens,
            "chain_held_slots_max": max(info.physical_tokens)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--history", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig(
            model=write_shape_dir(args.shape, Path(tmp)), load_format="dummy", device=args.device, method="snapkv",
            method_config={"budget": args.budget, "window": args.window},
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.history + args.new_tokens + 64))
        on_gpu = engine.device.type == "cuda"
        turns = [one_turn(engine, args, seed, on_gpu) for seed in range(args.repeats)]
    result = {"shape": args.shape, "history": args.history, "new_tokens": args.new_tokens, "budget": args.budget,
              "window": args.window, "timed_on": "GPU kernel" if on_gpu else "host (no GPU)", "turns": turns,
              **{k: statistics.median(t[k] for t in turns)
                 for k in ("wall_ms", "vote_ms", "compact_ms", "attention_ms", "other_ms", "vote_host_ms",
                           "compact_host_ms")}}
    print(f"turn wall {result['wall_ms']:.1f} ms; {result['timed_on']} time: prefill attention "
          f"{result['attention_ms']:.1f} ms, vote {result['vote_ms']:.1f} ms, "
          f"compaction {result['compact_ms']:.1f} ms, other {result['other_ms']:.1f} ms; host time in the vote "
          f"{result['vote_host_ms']:.1f} ms, in the compaction {result['compact_host_ms']:.1f} ms "
          f"(medians of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
