"""How far bf16 logits sit from an fp32 reference, per attention backend (GPU).

The engine runs the same batched, chunked, prefix-hit workload as the GPU backend tests, with every output
token forced (so all runs see the same tokens at every step), once in fp32 on the torch backend (the
reference) and in bf16 on each backend. It prints, per architecture and backend, the norm-wise relative
error of each step's logits against the fp32 reference and against the bf16 torch backend, so a backend's
error can be read next to the error bf16 itself brings.

    python -m benchmarks.bf16_error [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.tiny_checkpoint import make_tiny_checkpoint

COMMON = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
              vocab_size=512, max_position_embeddings=1024)
ARCHS = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32},
         "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(48)]
    prompts, params = [], []
    for i, n in enumerate([5, 300, 17, 64, 130, 33, 8, 250]):
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(system + body if i % 2 == 0 else body)
        forced = [rng.randrange(3, vocab) for _ in range(12)]
        params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, forced_token_ids=forced))
    return prompts, params


def step_logits(model_dir: Path, backend: str, dtype: str, eager: bool, device: str = "cuda") -> list[torch.Tensor]:
    llm = LLM(model_dir, device=device, dtype=dtype, attention_backend=backend, max_num_batched_tokens=64,
              enforce_eager=eager, max_num_seqs=16, kv_cache_memory_bytes=256 * 2**20)
    log: list[torch.Tensor] = []
    sample = llm.engine.runner.sampler.sample

    def recording(logits, *args):
        log.append(logits.float().cpu())
        return sample(logits, *args)

    prompts, params = workload(llm.engine.model_config.vocab_size)
    llm.generate(prompts[:1], params[:1])  # warm the prefix cache
    llm.engine.runner.sampler.sample = recording
    llm.generate(prompts, params)
    return log


def rel_errors(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    assert [x.shape for x in a] == [y.shape for y in b], "runs took different schedules"
    return [((x - y).norm() / y.norm()).item() for x, y in zip(a, b)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--initializer-range", type=float, default=0.02,
                    help="the tiny models' init scale (0.1 makes them amplify rounding ~2.5x more)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (arch, extra) in enumerate(ARCHS.items(), start=1):
            model_dir = make_tiny_checkpoint(Path(tmp) / arch, arch, seed=seed, **COMMON, **extra,
                                             initializer_range=args.initializer_range)
            ref32 = step_logits(model_dir, "torch", "float32", True, args.device)
            ref16 = step_logits(model_dir, "torch", "bfloat16", True, args.device)
            for backend in args.backends.split(","):
                for eager in (True, False) if backend == "triton" else (True,):
                    try:
                        got = ref16 if backend == "torch" else step_logits(model_dir, backend, "bfloat16", eager, args.device)
                    except Exception as exc:  # noqa: BLE001 - e.g. flashinfer not installed
                        print(f"{arch} {backend}: skipped ({exc})")
                        continue
                    e32, e16 = rel_errors(got, ref32), rel_errors(got, ref16)
                    rows.append({"arch": arch, "backend": backend, "cuda_graphs": not eager, "steps": len(e32),
                                 "vs_fp32_median": statistics.median(e32), "vs_fp32_max": max(e32),
                                 "vs_bf16_torch_median": statistics.median(e16), "vs_bf16_torch_max": max(e16)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'arch':<10} {'backend':<11} {'graphs':>6} {'vs fp32 med/max':>18} {'vs bf16 torch med/max':>22}")
    for r in rows:
        print(f"{r['arch']:<10} {r['backend']:<11} {str(r['cuda_graphs']):>6} "
              f"{r['vs_fp32_median']:>8.2e}/{r['vs_fp32_max']:.2e} {r['vs_bf16_torch_median']:>11.2e}/"
              f"{r['vs_bf16_torch_max']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
