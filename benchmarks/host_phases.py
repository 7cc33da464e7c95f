"""The engine's host work per decode step at large batches: schedule, prepare, update (and execute) medians.

    python -m benchmarks.host_phases --batch 256 --layers 32 --methods 'dense;kvzip:{"budget":64}'

On a GPU these phases run while the device idles (the engine does not overlap them with a step), so at the few
hundred requests of the sparse methods' largest batches they are part of every step's time. A model of the
named shape ``tiny`` cut down to ``--layers`` layers of one KV head (so that ``execute`` stays small on a CPU)
serves ``--batch`` requests of ``--prompt`` random tokens; once every prompt is in (and a method has evicted),
``--steps`` decode steps are timed by the engine's own step timing. Methods with per-layer lengths (KVzip's
non-uniform budgets, PyramidKV) exercise the per-layer views and slot mappings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.sparse_decode import parse_specs
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from benchmarks.model_shapes import get_shape
from engine.sampling_params import SamplingParams
from engine.tiny_checkpoint import train_tokenizer

PHASES = ("schedule", "prepare", "execute", "update")


def measure(model_dir: Path, method: str, cfg: dict, args, storage: str | None = None,
            storage_cfg: dict | None = None) -> dict:
    engine = LLMEngine(EngineConfig(
        model=model_dir, load_format="dummy", dtype="float32", device="cpu", page_size=args.page_size,
        method=method, method_config=cfg, kv_storage=storage, kv_storage_config=storage_cfg or {},
        max_num_seqs=args.batch, max_model_len=args.prompt + args.steps + 16,
        max_num_batched_tokens=max(4096, args.prompt * 8), enable_prefix_caching=False))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(500) for _ in range(args.prompt)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine._requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(args.steps):
        engine.step()
        for p in PHASES:
            phases[p].append(1e3 * getattr(engine.last_step, f"{p}_s"))
    return {"method": method if storage is None else f"{method}+{storage}", "config": cfg, "batch": args.batch,
            "layers": args.layers, "prompt": args.prompt,
            "step_phase_ms": {p: statistics.median(v) for p, v in phases.items()},
            "host_ms": sum(statistics.median(phases[p]) for p in ("schedule", "prepare", "update"))}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--methods", default='dense;kvzip:{"budget":64}')
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shape = get_shape("tiny")
    shape.update(num_hidden_layers=args.layers, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(shape))
        train_tokenizer().save_pretrained(model_dir)
        for method, cfg, storage, storage_cfg in parse_specs(args.methods, None):
            rows.append(measure(model_dir, method, cfg, args, storage, storage_cfg))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{'method':<14} {'batch':>5} {'layers':>6} " + "".join(f"{p:>10}" for p in PHASES) + f"{'host':>8}")
    for r in rows:
        ph = r["step_phase_ms"]
        print(f"{r['method']:<14} {r['batch']:>5} {r['layers']:>6} " + "".join(f"{ph[p]:>10.2f}" for p in PHASES)
              + f"{r['host_ms']:>8.2f}")
    return rows


if __name__ == "__main__":
    main()
