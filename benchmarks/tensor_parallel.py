"""Tensor-parallel throughput: the same shape and batch at tensor_parallel_size 1 and N, random weights.

Prints one JSON object per run and a table. A run that cannot be served (a shape too large for one GPU at
TP=1) is reported with ``fits: false`` and the engine's error instead of numbers.

    python -m benchmarks.tensor_parallel --shape llama-3.1-8b --tp 1,2 --batch 32 --context 4096
    python -m benchmarks.tensor_parallel --shape llama-70b-like --tp 1,2 --batch 1 --context 130944 --auto-pages
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.throughput import run_one, write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from benchmarks.model_shapes import get_shape

# Llama-3.1-70B's dimensions on the 8B config: ~131 GiB of bf16 weights, 320 KiB of KV per token.
LLAMA_70B_LIKE = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def shape_dir(shape: str, root: Path) -> Path:
    if shape != "llama-70b-like":
        return write_shape_dir(shape, root)
    from engine.tiny_checkpoint import train_tokenizer

    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**get_shape("llama-3.1-8b"), **LLAMA_70B_LIKE}))
    train_tokenizer().save_pretrained(out)
    return out


def run_case(model_dir: Path, args, tp: int) -> dict:
    r = dict(shape=args.shape, tp=tp, batch=args.batch, context=args.context)
    pages = None if args.auto_pages else args.batch * (-(-(args.context + args.decode_tokens) // 16) + 1)
    t0 = time.perf_counter()
    engine = None
    try:
        engine = LLMEngine(EngineConfig(
            model_dir, load_format="dummy", device=args.device, tensor_parallel_size=tp, max_num_seqs=args.batch,
            max_model_len=args.context + args.decode_tokens + 1, enable_prefix_caching=False,
            enforce_eager=args.enforce_eager, num_pages=pages, gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens))
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        r.update(build_s=round(time.perf_counter() - t0, 1), kv_pages=engine.pool.num_pages,
                 rank0_weight_gib=round(weight_bytes / 2**30, 2))
        run_one(engine, 1, min(args.context, 256), 4, args.seed)  # compile / warm up
        r.update(run_one(engine, args.batch, args.context, args.decode_tokens, args.seed), fits=True)
        if engine.device.type == "cuda":
            r["rank0_peak_gib"] = round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 2)
    except Exception as exc:  # noqa: BLE001 -- reported as the run's result (e.g. does not fit one GPU)
        r.update(fits=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return r


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", help="a name in benchmarks.model_shapes, or llama-70b-like")
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor_parallel_size values")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--auto-pages", action="store_true", help="size the KV pool from free memory, not the need")
    ap.add_argument("--enforce-eager", action="store_true", help="also no CUDA graphs at TP=1 (TP>1 never uses them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = shape_dir(args.shape, Path(tmp))
        for tp in (int(x) for x in args.tp.split(",")):
            results.append(run_case(model_dir, args, tp))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{'shape':>15} {'tp':>3} {'batch':>5} {'context':>7} {'fits':>5} {'prefill tok/s':>14} "
          f"{'decode tok/s':>13} {'step ms':>8} {'rank0 GiB':>9}")
    for r in results:
        head = f"{r['shape']:>15} {r['tp']:>3} {r['batch']:>5} {r['context']:>7}"
        if r["fits"]:
            print(f"{head} {'yes':>5} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} "
                  f"{r['decode_step_ms']:>8.2f} {r.get('rank0_peak_gib', r['rank0_weight_gib']):>9}")
        else:
            print(f"{head} {'no':>5}  {r['error'][:100]}")
    base = next((r for r in results if r["fits"] and r["tp"] == 1), None)
    for r in results:
        if base is not None and r["fits"] and r["tp"] > 1:
            print(f"decode tok/s TP{r['tp']} / TP1: {r['decode_tok_s'] / base['decode_tok_s']:.2f}x")
    return results


if __name__ == "__main__":
    main()
