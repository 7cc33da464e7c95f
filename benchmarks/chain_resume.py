"""Resume latency of an idle chain: its next turn's time to first token when its KV is still on the device, in
host memory, in its disk file, or gone (recomputed from its tokens).

One chain of ``--context`` tokens is built (untimed). Each timed turn appends ``--new-tokens`` tokens (a tool
result) and asks for one token; the time runs from ``add_request`` to the step that returns the token, so it
holds the load back to the device (host: a copy; disk: reading and checking the file, then the copy), the new
tokens' prefill and the first token's sampling. Between turns the chain is rewound to its ``--context`` tokens
(exact for dense KV), so every turn starts from the same state. ``recompute`` is the same turn on a chain with
nothing retained (prefix caching off): the whole history prefilled again, what a reclaimed chain costs without
tiers. ``disk`` reads a file the OS may still cache (it was just written); ``--drop-page-cache`` asks the kernel
to drop its page cache before each such turn (root only) so the read comes from the device.

Each mode: the median of ``--repeats`` turns, with min and max, after one untimed round of every mode.

    python -m benchmarks.chain_resume --shape llama-3.1-8b --context 32768
    python -m benchmarks.chain_resume --shape tiny --context 2048 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.throughput import write_shape_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

MODES = ("resident", "host", "disk", "recompute")
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _turn(engine: LLMEngine, chain_id: str, prompt: list[int]):
    """(seconds from add_request to the finished one-token turn, its output)."""
    _sync(engine.device)
    start = time.perf_counter()
    final = run_to_end(engine, engine.add_request(prompt, ONE_TOKEN, chain_id=chain_id))
    _sync(engine.device)
    return time.perf_counter() - start, final


def run_to_end(engine: LLMEngine, request_id: str):
    """Step ``engine`` until nothing is left; the final output of ``request_id``."""
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def _drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(args, model_dir: Path, disk_dir: Path) -> list[dict]:
    # host and disk tiers sized for a few copies of the chain; the pool for the chain and one recomputed copy
    engine = LLMEngine(EngineConfig(
        model=model_dir, load_format="safetensors" if args.model else "dummy", dtype=args.dtype, device=args.device,
        page_size=args.page_size, enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.context + args.new_tokens * (args.repeats + 2) + 8, num_pages=args.num_pages,
        kv_cache_memory_bytes=args.kv_bytes, chain_host_bytes=args.tier_bytes, chain_disk_dir=str(disk_dir),
        chain_disk_bytes=args.tier_bytes))
    rng = torch.Generator().manual_seed(args.seed)
    vocab = engine.model_config.vocab_size
    history = torch.randint(3, vocab, (args.context - 1,), generator=rng).tolist()
    _, first = _turn(engine, "c", history)  # untimed: the chain's history
    history = history + first.token_ids
    tiers = engine.chains.tiers
    tiers.cost_aware = False  # the disk mode times the file's load even where recomputing would be faster
    chain_bytes = None
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats + 1):  # round 0 is the warm-up
        for mode in MODES:
            new = torch.randint(3, vocab, (args.new_tokens,), generator=rng).tolist()
            chain_id = "c" if mode != "recompute" else f"fresh-{rep}"
            dropped = None
            if mode in ("host", "disk"):
                assert engine.release_chain("c") and engine.chain_info("c").status == "host"
                entry = engine.chains.index.get("c").offloaded
                chain_bytes = entry.nbytes
                if mode == "disk":
                    assert tiers.persist_entry(entry) and engine.chain_info("c").status == "disk"
                    dropped = _drop_page_cache() if args.drop_page_cache else None
            before = dict(tiers.counters.seconds)
            seconds, out = _turn(engine, chain_id, history + new)
            expected = {"resident": "resumed", "host": "loaded", "disk": "loaded", "recompute": "created"}[mode]
            if out.resume_status != expected:
                raise RuntimeError(f"{mode}: the turn was {out.resume_status}, not {expected}")
            if rep > 0:
                samples[mode].append({"ttft_s": seconds, "prefilled": out.num_prefilled_tokens,
                                      "resumed": out.num_resumed_tokens, "page_cache_dropped": dropped,
                                      "load_s": sum(tiers.counters.seconds[k] - before[k]
                                                    for k in ("load_host", "load_disk"))})
            if mode == "recompute":
                engine.delete_chain(chain_id)
            else:
                engine.rewind_chain("c", len(history))
    results = []
    for mode in MODES:
        ttft = [s["ttft_s"] * 1e3 for s in samples[mode]]
        load = [s["load_s"] * 1e3 for s in samples[mode]]
        results.append({
            "mode": mode, "context": len(history), "new_tokens": args.new_tokens, "repeats": args.repeats,
            "ttft_ms": statistics.median(ttft), "ttft_ms_min": min(ttft), "ttft_ms_max": max(ttft),
            "load_ms": statistics.median(load), "prefilled": samples[mode][0]["prefilled"],
            "resumed": samples[mode][0]["resumed"], "chain_bytes": chain_bytes,
            "page_cache_dropped": samples[mode][0]["page_cache_dropped"], "device": str(engine.device),
            "backend": engine.backend.name, "shape": args.shape if not args.model else str(args.model),
            "timed": "add_request to the finished one-token turn: load back (host / disk), prefill of the new tokens "
                     "(of the whole history for recompute), sampling"})
    engine.close()
    return results


def print_table(results: list[dict]) -> None:
    print(f"\n{'mode':<10} {'context':>8} {'new':>5} {'TTFT ms median [min-max]':>30} {'load ms':>9} "
          f"{'prefilled':>9} {'vs recompute':>12}")
    base = next(r for r in results if r["mode"] == "recompute")
    for r in results:
        spread = f"{r['ttft_ms']:.1f} [{r['ttft_ms_min']:.1f}-{r['ttft_ms_max']:.1f}]"
        print(f"{r['mode']:<10} {r['context']:>8} {r['new_tokens']:>5} {spread:>30} {r['load_ms']:>9.1f} "
              f"{r['prefilled']:>9} {base['ttft_ms'] / r['ttft_ms']:>11.2f}x")


def main(argv: list[str] | None = None) -> list[dict]:
    from engine.cli_args import checkpoint_dir, device, positive_int
    from engine.config import DTYPES
    from benchmarks.model_shapes import SHAPES

    ap = argparse.ArgumentParser(prog="python -m benchmarks.chain_resume", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="a named shape with random weights")
    ap.add_argument("--model", type=checkpoint_dir, help="a checkpoint directory instead of --shape")
    ap.add_argument("--context", type=positive_int, default=32768, help="the chain's tokens before a timed turn")
    ap.add_argument("--new-tokens", type=positive_int, default=256, help="tokens a timed turn appends")
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed turns per mode")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=16384)
    ap.add_argument("--page-size", type=positive_int, default=16)
    ap.add_argument("--kv-bytes", type=positive_int, default=None, help="KV budget in bytes (default: the engine's)")
    ap.add_argument("--num-pages", type=positive_int, default=None, help="KV pool pages (overrides --kv-bytes)")
    ap.add_argument("--tier-bytes", type=positive_int, default=64 * 2**30, help="host and disk tier sizes")
    ap.add_argument("--drop-page-cache", action="store_true", help="drop the OS page cache before disk turns")
    ap.add_argument("--device", type=device, default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_shape_dir(args.shape, Path(tmp) / "model")
        results = run(args, model_dir, Path(tmp) / "chains")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results), file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
