"""Offline throughput benchmark: prefill and decode tok/s for a batch, context length and model shape.

Model shapes come by name (``engine.model_shapes``) with random weights, so it runs where no weights can be
downloaded. Prints one JSON object per run and a table.

    python -m engine.bench --shape tiny --batch 1,32 --context 256 --decode-tokens 64
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

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_shapes import get_shape
from engine.sampling_params import SamplingParams


def write_shape_dir(shape: str, root: Path) -> Path:
    """config.json of the named shape plus the project's tokenizer; weights come from load_format='dummy'."""
    from engine.tiny_checkpoint import train_tokenizer

    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(get_shape(shape)))
    train_tokenizer().save_pretrained(out)
    return out


def run_one(engine: LLMEngine, batch: int, context: int, decode_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    first_tokens = 0
    while first_tokens < batch:
        first_tokens += sum(1 for o in engine.step() if len(o.token_ids) == 1)
    sync()
    t1 = time.perf_counter()
    overheads, steps = [], 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        timing = engine.last_step
        if timing is not None and timing.num_requests == batch:
            overheads.append(timing.schedule_s + timing.prepare_s)
    sync()
    t2 = time.perf_counter()
    decoded = batch * (decode_tokens - 1)
    return {
        "batch": batch,
        "context": context,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": batch * context / (t1 - t0),
        "decode_tok_s": decoded / (t2 - t1) if decoded else 0.0,
        "decode_step_ms": 1e3 * (t2 - t1) / max(steps, 1),
        "sched_prep_ms_per_decode_step": 1e3 * statistics.median(overheads) if overheads else None,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", help="a checkpoint dir instead of a named shape with random weights")
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_shape_dir(args.shape, Path(tmp))
        tokens_per_req = args.context + args.decode_tokens
        config = EngineConfig(
            model=model_dir, dtype=args.dtype, device=args.device, load_format="safetensors" if args.model else "dummy",
            max_num_seqs=max(batches), max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(tokens_per_req + 1, 64), enable_prefix_caching=False,
            num_pages=max(batches) * (-(-tokens_per_req // 16) + 1), attention_backend=args.attention_backend,
        )
        engine = LLMEngine(config)
        results = []
        for b in batches:
            r = run_one(engine, b, args.context, args.decode_tokens, args.seed)
            r.update(shape=args.model or args.shape, device=str(engine.device), dtype=str(engine.cache.spec.dtype),
                     backend=engine.backend.name)
            print(json.dumps(r))
            results.append(r)
    print(f"\n{'batch':>5} {'context':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'step ms':>8} {'sched+prep ms':>14}")
    for r in results:
        sp = r["sched_prep_ms_per_decode_step"]
        print(f"{r['batch']:>5} {r['context']:>7} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_step_ms']:>8.2f} {sp if sp is None else round(sp, 3):>14}")
    return results


if __name__ == "__main__":
    main()
