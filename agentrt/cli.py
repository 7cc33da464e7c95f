"""The ``agentrt`` command.

    agentrt generate "Write a haiku about KV caches"    # offline generation on the embedded tiny model
    agentrt bench --shape tiny --batch 1,32              # throughput benchmark (JSON + table)
    agentrt make-tiny --arch llama --out /tmp/tiny       # write a random tiny HF checkpoint
"""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.tiny_checkpoint import default_model_dir

    model = args.model or default_model_dir()
    llm = LLM(model, device=args.device, max_num_batched_tokens=args.chunk)
    prompts = args.prompts or ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}, "
              f"{out.num_cached_tokens} cached]")
    return 0


def _bench(rest: list[str]) -> int:
    from engine.bench import main as bench_main

    bench_main(rest)
    return 0


def _make_tiny(rest: list[str]) -> int:
    from engine.tiny_checkpoint import main as tiny_main

    tiny_main(rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "make-tiny":
        return _make_tiny(argv[1:])
    ap = argparse.ArgumentParser(prog="agentrt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="throughput benchmark (see agentrt bench --help)")
    sub.add_parser("make-tiny", help="write a random tiny checkpoint (see agentrt make-tiny --help)")
    gen = sub.add_parser("generate", help="offline generation demo on the embedded tiny model")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--chunk", type=int, default=2048, help="token budget per step (prefill chunk)")
    args = ap.parse_args(argv)
    return _generate(args)


if __name__ == "__main__":
    raise SystemExit(main())
