"""Kernel time breakdown of one decode step (graph replays under torch.profiler).

    python benchmarks/profile_decode.py --shape llama-3.1-8b --batch 1 --context 4096
"""

import argparse
import random
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench import write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp))
        engine = LLMEngine(EngineConfig(model=model_dir, load_format="dummy", max_num_seqs=args.batch,
                                        max_model_len=args.context + 64, enable_prefix_caching=False,
                                        num_pages=args.batch * (args.context // 16 + 8),
                                        max_num_batched_tokens=16384))
        rng = random.Random(0)
        for _ in range(args.batch):
            engine.add_request([rng.randrange(1000) for _ in range(args.context)],
                               SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        for _ in range(4):
            engine.step()
        graph = engine.runner.graphs.graphs[engine.runner.graphs.bucket_for(args.batch)]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main()
