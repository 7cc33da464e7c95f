"""The ``agentrt`` command.

    agentrt generate "Write a haiku about KV caches"    # offline generation on the embedded tiny model
    agentrt bench --shape tiny --batch 1,32              # throughput benchmark (JSON + table)
    agentrt make-tiny --arch llama --out /tmp/tiny       # write a random tiny HF checkpoint
    agentrt eval --methods snapkv,quest --budgets 0.25   # quality: accuracy per method x budget (docs/quality.md)
    agentrt replay run --sessions 4 --turns 8            # agent-trace replay benchmark (see agentrt replay --help)
    agentrt serve --port 8000                            # the HTTP server (chains, turns, OpenAI routes)
    agentrt demo                                         # a scripted 8-turn agent session, lag-2 pruning
    agentrt keys create --tenant acme [--db URL]         # a new API key for a tenant (printed once)
    agentrt keys list [--tenant acme] / keys revoke KEY_ID
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from agentrt.config import embedded_model_dir

    model = args.model or embedded_model_dir()
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


def _eval(rest: list[str]) -> int:
    import importlib

    # quality sits above the server in the import layers, so it is found by name rather than imported
    return importlib.import_module("quality.eval").main(rest)


def _make_tiny(rest: list[str]) -> int:
    from engine.tiny_checkpoint import main as tiny_main

    tiny_main(rest)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from agentrt.config import is_loopback

    from agentrt.app import build_engine, create_app
    from agentrt.config import ConfigurationError, ServerConfig
    from engine.errors import EngineError

    configs = {}
    for flag, text in (("--method-config", args.method_config), ("--kv-storage-config", args.kv_storage_config)):
        try:
            configs[flag] = json.loads(text)
        except json.JSONDecodeError as exc:
            print(f"{flag} is not JSON: {exc}", file=sys.stderr)
            return 2
        if not isinstance(configs[flag], dict):
            print(f"{flag} must be a JSON object", file=sys.stderr)
            return 2
    method_config = configs["--method-config"]
    engine_options = {"device": args.device, "tensor_parallel_size": args.tp, "decode_steps": args.decode_steps}
    if args.kv_storage is not None:
        engine_options.update(kv_storage=args.kv_storage, kv_storage_config=configs["--kv-storage-config"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(model=args.model, model_name=args.model_name, db_url=args.db, method=args.method,
                          method_config=method_config, host=args.host,
                          engine_options=engine_options,
                          require_auth=args.require_auth, max_body_size=args.max_body_size,
                          max_tokens_per_turn=args.max_tokens_per_turn,
                          max_chains_per_tenant=args.max_chains_per_tenant or None,
                          max_queue_depth=args.max_queue_depth or None)
    try:
        config.check()
        if config.auth_required and not is_loopback(config.host) and not asyncio.run(_count_keys(config.db_url)):
            raise ConfigurationError(f"refusing to serve on {config.host!r} (not loopback) with no active API key "
                                     "in the database: create one with `agentrt keys create --tenant NAME"
                                     + (f" --db {config.db_url}" if config.db_url else "") + "`")
    except ConfigurationError as exc:
        print(f"agentrt serve: {exc}", file=sys.stderr)
        return 2
    try:
        engine = build_engine(config)
    except EngineError as exc:
        print(f"cannot start the engine: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(config, engine=engine), host=args.host, port=args.port, log_level="info")
    return 0


async def _count_keys(db_url: str | None) -> int:
    from agentrt.auth import KeyService
    from agentrt.config import default_db_url
    from agentrt.db import open_database

    db = await open_database(db_url or default_db_url())
    try:
        return await KeyService(db).count_active()
    finally:
        await db.dispose()


async def _keys_async(args: argparse.Namespace) -> int:
    from agentrt.auth import InvalidTenant, KeyService
    from agentrt.config import default_db_url
    from agentrt.db import open_database

    db = await open_database(args.db or default_db_url())
    try:
        keys = KeyService(db)
        if args.keys_command == "create":
            try:
                created = await keys.create(args.tenant, args.name)
            except InvalidTenant as exc:
                print(f"agentrt keys create: {exc}", file=sys.stderr)
                return 2
            print(created.key)
            print(f"key id {created.key_id} for tenant {created.tenant!r}; the key is shown only this once",
                  file=sys.stderr)
            return 0
        if args.keys_command == "revoke":
            if not await keys.revoke(args.key_id):
                print(f"agentrt keys revoke: no active key {args.key_id!r}", file=sys.stderr)
                return 1
            print(f"revoked {args.key_id}")
            return 0
        for row in await keys.list(args.tenant):
            state = "revoked" if row.revoked_at is not None else "active"
            print(f"{row.key_id}\t{row.tenant}\t{state}\t{row.created_at:.0f}\t{row.name or ''}")
        return 0
    finally:
        await db.dispose()


def _demo(args: argparse.Namespace) -> int:
    from agentrt.demo import main as demo_main

    return demo_main(args.url, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "replay":
        from agentrt.replay.cli import main as replay_main

        return replay_main(argv[1:])
    if argv and argv[0] == "make-tiny":
        return _make_tiny(argv[1:])
    if argv and argv[0] == "eval":
        return _eval(argv[1:])
    ap = argparse.ArgumentParser(prog="agentrt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="throughput benchmark (see agentrt bench --help)")
    sub.add_parser("make-tiny", help="write a random tiny checkpoint (see agentrt make-tiny --help)")
    sub.add_parser("eval", help="quality: accuracy per method x budget x length x depth (see agentrt eval --help)")
    sub.add_parser("replay", help="agent-trace replay: generate traces, replay them (see agentrt replay --help)")
    gen = sub.add_parser("generate", help="offline generation demo on the embedded tiny model")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--chunk", type=int, default=2048, help="token budget per step (prefill chunk)")
    serve = sub.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny model)")
    serve.add_argument("--model-name", help="the model name clients use (default: the directory name)")
    serve.add_argument("--db", help="SQLAlchemy async URL (default: SQLite under ~/.cache/agentrt)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--method", default="dense", help="sparse method for every chain")
    serve.add_argument("--method-config", default="{}", help="the method's knobs as a JSON object")
    serve.add_argument("--kv-storage", help="how retained KV is stored: fp8, kivi, turboquant, palu (default: the model dtype)")
    serve.add_argument("--kv-storage-config", default="{}", help="the storage's knobs as a JSON object")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks: GPUs (NCCL) from --device on, or gloo processes on CPU")
    serve.add_argument("--decode-steps", type=int, default=1,
                       help="decode steps run back to back on the device per schedule (deltas of up to N tokens)")
    serve.add_argument("--require-auth", dest="require_auth", action="store_true", default=None,
                       help="require API keys (the default unless --host is a loopback address)")
    serve.add_argument("--no-auth", dest="require_auth", action="store_false",
                       help="serve without API keys (only allowed on a loopback --host)")
    serve.add_argument("--max-body-size", type=int, default=8 * 2**20, help="bytes per request body")
    serve.add_argument("--max-tokens-per-turn", type=int, default=4096, help="the largest sampling.max_tokens")
    serve.add_argument("--max-chains-per-tenant", type=int, default=1000, help="0: unlimited")
    serve.add_argument("--max-queue-depth", type=int, default=256,
                       help="engine requests in flight before new ones get 503 (0: unbounded)")
    keys = sub.add_parser("keys", help="manage API keys (create / list / revoke)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    for name, text in (("create", "create a key for a tenant; prints the key once"), ("list", "list keys"),
                       ("revoke", "revoke a key by its id")):
        p = keys_sub.add_parser(name, help=text)
        p.add_argument("--db", help="SQLAlchemy async URL (default: SQLite under ~/.cache/agentrt)")
        if name == "create":
            p.add_argument("--tenant", required=True)
            p.add_argument("--name", help="a label for the key")
        elif name == "list":
            p.add_argument("--tenant")
        else:
            p.add_argument("key_id")
    demo = sub.add_parser("demo", help="a scripted 8-turn tool-using agent session with a lag-2 pruning policy")
    demo.add_argument("--url", help="an agentrt server to talk to (default: start one in-process)")
    demo.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "keys":
        return asyncio.run(_keys_async(args))
    return _generate(args)


if __name__ == "__main__":
    raise SystemExit(main())
