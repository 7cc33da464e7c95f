"""Where a sparse method's decode step goes: host wall time per step, the CUDA kernels and the CPU ops of a
few steps under torch.profiler, on the synthetic long-context workload of ``benchmarks.sparse_decode``.

    python -m benchmarks.profile_sparse --shape llama-3.1-8b --context 128000 --batch 7 \\
        --method 'omnikv:{"token_budget":4096}'
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.sparse_decode import add_synthetic, parse_methods
from benchmarks.throughput import write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--context", type=int, default=128000)
    ap.add_argument("--batch", type=int, default=7)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--method", default="dense")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args(argv)
    ((name, cfg),) = parse_methods(args.method)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp))
        max_tokens = 64 + 4 * args.steps
        engine = LLMEngine(EngineConfig(
            model=model_dir, load_format="dummy", method=name, method_config=cfg, enable_prefix_caching=False,
            max_num_seqs=args.batch, max_model_len=args.context + max_tokens + 8,
            max_num_batched_tokens=max(args.window, 256), enforce_eager=args.enforce_eager,
            cuda_graph_max_batch=args.batch))
        rng, gen = random.Random(0), torch.Generator(device=engine.device).manual_seed(0)
        admitted = 0
        while admitted < args.batch and add_synthetic(engine, args.context, args.window, max_tokens, rng, gen):
            admitted += 1
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine._requests.values()):
                engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        cuda_us = sum(e.self_device_time_total for e in events) / args.steps
        result = {"method": name, "config": cfg, "batch": admitted, "context": args.context, "step_ms": step_ms,
                  "gpu_busy_ms_per_step": cuda_us / 1e3,
                  "graphs_replayed": engine.runner.graphs.replays if engine.runner.graphs else 0}
        print(json.dumps(result))
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        return result


if __name__ == "__main__":
    main()
