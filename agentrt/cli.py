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

A mistake in the flags prints one line to stderr (the command, the flag, what to do) and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

from agentrt.tool_syntax import SYNTAXES
from engine.cli_args import (CommandLineParser, checked_after_parsing, checkpoint_dir, device, json_object,
                                    non_negative_float, non_negative_int, positive_int, usage_error)

DB_HELP = ("SQLAlchemy URL with an async driver: sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB "
           "(default: SQLite under ~/.cache/agentrt, or $AGENTRT_CACHE)")
# the asyncio driver to suggest for a URL that names a backend without one
ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mysql": "aiomysql", "mariadb": "aiomysql"}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b?)", re.IGNORECASE)


def _db_reachable(text: str) -> None:
    """The URL's driver is installed and, for a SQLite file, its directory exists."""
    from sqlalchemy.engine import make_url

    url = make_url(text)
    shown = url.render_as_string(hide_password=True)
    try:
        url.get_dialect().import_dbapi()
    except ImportError as exc:
        raise argparse.ArgumentTypeError(f"{shown}: the driver {url.get_driver_name()!r} is not installed "
                                         f"(pip install {exc.name or url.get_driver_name()})") from None
    database = url.database
    if url.get_backend_name() == "sqlite" and database and database != ":memory:" and not database.startswith("file:"):
        if not Path(database).expanduser().resolve().parent.is_dir():
            raise argparse.ArgumentTypeError(f"{shown}: the directory of {database} does not exist")


@checked_after_parsing(_db_reachable)
def db_url(text: str) -> str:
    """A database URL the server can use: it parses, names a known database and an async driver."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    example = "sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB"
    try:
        url = make_url(text)
    except ArgumentError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a database URL; use {example}") from None
    shown = url.render_as_string(hide_password=True)
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise argparse.ArgumentTypeError(f"{shown}: SQLAlchemy knows no database {url.drivername!r}; "
                                         f"use {example}") from None
    if not dialect.is_async:
        backend = url.get_backend_name()
        driver = ASYNC_DRIVERS.get(backend)
        fix = (url.set(drivername=f"{backend}+{driver}").render_as_string(hide_password=True) if driver
               else f"a driver with asyncio support ({example})")
        raise argparse.ArgumentTypeError(f"{shown} names the driver {url.get_driver_name()!r}, which is not async "
                                         f"(the server reaches its database through asyncio); use {fix}")
    return text


def byte_size(text: str) -> int:
    """Bytes: a plain number, or with a unit (KiB, MiB, GiB, TiB or K, M, G, T: powers of 1024; KB, MB, GB, TB:
    powers of 1000)."""
    match = _SIZE.fullmatch(text.strip())
    number, prefix, suffix = match.groups() if match else ("", "", "")
    if match is None or suffix.lower() not in (("", "b", "ib") if prefix else ("", "b")):
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 4GiB or a number of bytes, got {text!r}")
    power = " kmgt".index(prefix.lower() or " ")
    base = 1000 if suffix.lower() == "b" and prefix else 1024
    size = int(float(number) * base**power)
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least one byte, got {text!r}")
    return size


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 0..65535, got {text!r}")
    return value


def http_url(text: str) -> str:
    if not re.match(r"https?://[^/\s]+", text):
        raise argparse.ArgumentTypeError(f"expected a server URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.errors import CheckpointError, EngineError, InvalidRequestError
    from agentrt.config import embedded_model_dir

    prog = "agentrt generate"
    model = args.model or embedded_model_dir()
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(model, device=args.device, max_num_batched_tokens=args.chunk)
    except CheckpointError as exc:
        return usage_error(prog, f"--model {model}: {exc}")
    except EngineError as exc:
        return usage_error(prog, exc)
    prompts = args.prompts or ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    try:
        outputs = llm.generate(prompts, params)
    except InvalidRequestError as exc:
        return usage_error(prog, f"a prompt: {exc}")
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}, "
              f"{out.num_cached_tokens} cached]")
    return 0


def _bench(rest: list[str]) -> int:
    from benchmarks.throughput import main as bench_main
    from engine.errors import EngineError

    try:
        bench_main(rest)
    except EngineError as exc:
        return usage_error("agentrt bench", exc)
    return 0


def _eval(rest: list[str]) -> int:
    import importlib

    from engine.errors import EngineError

    # quality sits above the server in the import layers, so it is found by name rather than imported
    try:
        return importlib.import_module("quality.eval").main(rest)
    except EngineError as exc:
        return usage_error("agentrt eval", exc)


def _make_tiny(rest: list[str]) -> int:
    from engine.tiny_checkpoint import main as tiny_main

    return tiny_main(rest)


def _check_engine_flags(args: argparse.Namespace, model: str | Path, engine_options: dict) -> str | None:
    """What is wrong with the engine's flags, checked without loading the model (None: nothing)."""
    from engine.config import EngineConfig
    from engine.errors import ConfigError
    from engine.model_config import ModelConfig
    from engine.registry import KV_STORAGE, METHODS, create_kv_storage, create_method

    for flag, name, config_flag, config, registry, create, what in (
            ("--method", args.method, "--method-config", args.method_config, METHODS, create_method, "method"),
            ("--kv-storage", args.kv_storage, "--kv-storage-config", args.kv_storage_config, KV_STORAGE,
             create_kv_storage, "KV storage")):
        if name is None:
            if config:
                return f"{config_flag} is set but {flag} is not: name the {what} the knobs are for"
            continue
        if name not in registry.names():
            return f"{flag} {name}: no such {what}; choose one of {', '.join(registry.names())}"
        try:
            create(name, config)
        except ConfigError as exc:
            return f"{config_flag}: {exc}"
    try:
        EngineConfig.from_kwargs(model, method=args.method, method_config=args.method_config, **engine_options)
    except ConfigError as exc:
        return str(exc)
    model_config = ModelConfig.from_dir(model)  # the architecture and shapes, from config.json alone
    if args.tp > 1:
        from engine.parallel.layers import check_model_shards

        try:
            check_model_shards(model_config, args.tp)
        except ConfigError as exc:
            return f"--tp {args.tp}: {exc}"
        if args.device.startswith("cuda") or args.device == "auto":
            import torch

            first = int(args.device.partition(":")[2] or 0)
            if torch.cuda.is_available() and first + args.tp > torch.cuda.device_count():
                return (f"--tp {args.tp}: needs {args.tp} GPUs from cuda:{first}; {torch.cuda.device_count()} "
                        "are visible")
    return None


def _serve(args: argparse.Namespace) -> int:
    import logging

    from agentrt.config import ConfigurationError, ServerConfig, default_db_url, embedded_model_dir, is_loopback
    from engine.errors import CheckpointError, EngineError

    prog = "agentrt serve"
    model = args.model or embedded_model_dir()
    engine_options = {"device": args.device, "tensor_parallel_size": args.tp, "decode_steps": args.decode_steps}
    if args.no_warmup:
        engine_options["warmup"] = False
    if args.num_pages is not None:
        engine_options["num_pages"] = args.num_pages
    if args.kv_cache_memory is not None:
        engine_options["kv_cache_memory_bytes"] = args.kv_cache_memory
    if args.kv_storage is not None:
        engine_options.update(kv_storage=args.kv_storage, kv_storage_config=args.kv_storage_config)
    if args.chain_host_memory is not None:
        engine_options["chain_host_bytes"] = args.chain_host_memory
    if args.chain_disk is not None:
        try:
            disk_bytes = byte_size(args.chain_disk[1])
        except argparse.ArgumentTypeError as exc:
            return usage_error(prog, f"--chain-disk SIZE: {exc}")
        engine_options.update(chain_disk_dir=args.chain_disk[0], chain_disk_bytes=disk_bytes)
    try:
        problem = _check_engine_flags(args, model, engine_options)
    except CheckpointError as exc:
        problem = f"--model {model}: {exc}"
    if problem:
        return usage_error(prog, problem)
    config = ServerConfig(model=args.model, model_name=args.model_name, db_url=args.db, method=args.method,
                          method_config=args.method_config, host=args.host,
                          engine_options=engine_options,
                          require_auth=args.require_auth, max_body_size=args.max_body_size,
                          max_tokens_per_turn=args.max_tokens_per_turn,
                          max_chains_per_tenant=args.max_chains_per_tenant or None,
                          max_queue_depth=args.max_queue_depth or None,
                          max_method_configs_per_tenant=args.max_method_configs_per_tenant or None,
                          allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
                          implicit_chains=args.implicit_chains, tool_call_syntax=args.tool_call_syntax)
    off_loopback = not is_loopback(config.host)
    try:
        config.check()
    except ConfigurationError as exc:
        return usage_error(prog, f"--host {args.host}: {exc}" if off_loopback and not config.auth_required else exc)
    active_keys = _run_db(args.db, _count_keys(config.db_url or default_db_url()))
    if isinstance(active_keys, str):
        return usage_error(prog, active_keys)
    if config.auth_required and off_loopback and not active_keys:
        return usage_error(prog, f"--host {args.host}: refusing to serve on {config.host!r} (not loopback) with no "
                                 "active API key in the database: create one with `agentrt keys create --tenant NAME"
                                 + (f" --db {config.db_url}" if config.db_url else "") + "`")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas is not None:
        return _serve_replicas(args, config)
    import uvicorn

    from agentrt.app import build_engine, create_app

    try:
        engine = build_engine(config)
    except CheckpointError as exc:
        return usage_error(prog, f"--model {model}: {exc}")
    except EngineError as exc:
        return usage_error(prog, f"cannot start the engine: {exc}")
    uvicorn.run(create_app(config, engine=engine), host=args.host, port=args.port, log_level="info",
                ws_max_size=config.max_body_size)
    return 0


def _serve_replicas(args: argparse.Namespace, config) -> int:
    """Engine replicas and HTTP replicas on Ray Serve (docs/scale-out.md)."""
    prog = "agentrt serve"
    try:
        from agentrt.scaleout.deploy import ScaleOut, serve_local
    except ImportError as exc:
        return usage_error(prog, f"--replicas needs Ray Serve: pip install 'agentrt[scaleout]' ({exc})")
    scale = ScaleOut(replicas=args.replicas, http_replicas=args.http_replicas, affinity=args.affinity,
                     engine_cpus=args.engine_cpus, engine_gpus=args.engine_gpus)
    try:
        scale.check()
    except ValueError as exc:
        return usage_error(prog, str(exc))
    try:
        serve_local(config, scale, args.port, ray_address=args.ray_address)
    except ValueError as exc:
        return usage_error(prog, str(exc))
    return 0


def _run_db(url: str | None, work):
    """Run ``work`` (a coroutine on the database); a database that cannot be opened is a message, not a raise."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return asyncio.run(work)
    except (OSError, SQLAlchemyError) as exc:
        where = f"--db {url}" if url else "the default database (--db names another)"
        return f"{where}: cannot open it: {exc}"


async def _count_keys(db_url: str) -> int:
    from agentrt.auth import KeyService
    from agentrt.db import open_database

    db = await open_database(db_url)
    try:
        return await KeyService(db).count_active()
    finally:
        await db.dispose()


def _utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key_table(rows) -> str:
    """A header, then one line per key; times are ISO-8601 UTC."""
    table = [("KEY ID", "TENANT", "STATE", "CREATED (UTC)", "NAME")]
    table += [(r.key_id, r.tenant, "active" if r.revoked_at is None else f"revoked {_utc(r.revoked_at)}",
               _utc(r.created_at), r.name or "") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


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
                return usage_error("agentrt keys create", f"--tenant: {exc}")
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
        rows = await keys.list(args.tenant)
        print(_key_table(rows))
        if not rows:
            print("no keys; create one with `agentrt keys create --tenant NAME`", file=sys.stderr)
        return 0
    finally:
        await db.dispose()


def _keys(args: argparse.Namespace) -> int:
    prog = f"agentrt keys {args.keys_command}"
    result = _run_db(args.db, _keys_async(args))
    return usage_error(prog, result) if isinstance(result, str) else result


def _demo(args: argparse.Namespace) -> int:
    import httpx

    from agentrt.demo import main as demo_main

    from sdk.errors import AgentrtError

    try:
        return demo_main(args.url, args.max_tokens)
    except (httpx.TransportError, AgentrtError) as exc:
        if args.url is None:
            raise  # the in-process server: not the user's doing
        if isinstance(exc, AgentrtError) and exc.status_code is not None:
            return usage_error("agentrt demo", f"--url {args.url}: the server refused the session ({exc})")
        return usage_error("agentrt demo", f"--url {args.url}: cannot reach the server ({exc})")


def _model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=checkpoint_dir,
                   help="a local Hugging Face checkpoint directory (default: the embedded tiny model)")


def build_parser() -> argparse.ArgumentParser:
    ap = CommandLineParser(prog="agentrt", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("bench", help="throughput benchmark (see agentrt bench --help)")
    sub.add_parser("make-tiny", help="write a random tiny checkpoint (see agentrt make-tiny --help)")
    sub.add_parser("eval", help="quality: accuracy per method x budget x length x depth (see agentrt eval --help)")
    sub.add_parser("replay", help="agent-trace replay: generate traces, replay them (see agentrt replay --help)")

    gen = sub.add_parser("generate", help="offline generation on the embedded tiny model",
                         description="Offline generation (greedy by default) of each prompt, without a server.")
    gen.add_argument("prompts", nargs="*", help="the prompts (default: three short examples)")
    _model_flag(gen)
    gen.add_argument("--max-tokens", type=positive_int, default=32, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--device", type=device, default="auto", help="auto (a GPU when visible), cpu or cuda[:N]")
    gen.add_argument("--chunk", type=positive_int, default=2048, help="token budget per step (prefill chunk)")

    serve = sub.add_parser("serve", help="run the HTTP server",
                           description="The HTTP server: chains, turns (SSE, WebSocket), OpenAI-compatible routes\n"
                                       "(docs/server.md). Engine options: docs/configuration.md.")
    _model_flag(serve)
    serve.add_argument("--model-name", help="the model name clients use (default: the directory name)")
    serve.add_argument("--db", type=db_url, help=DB_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind")
    serve.add_argument("--port", type=port, default=8000, help="the port to bind")
    serve.add_argument("--method", default="dense", help="the sparse method chains use unless they name one "
                                                          "(docs/methods.md)")
    serve.add_argument("--method-config", type=json_object, default="{}", help="the method's knobs as a JSON object")
    serve.add_argument("--kv-storage", help="how retained KV is stored: fp8, kivi, turboquant, palu "
                                            "(default: the model dtype)")
    serve.add_argument("--kv-storage-config", type=json_object, default="{}",
                       help="the storage's knobs as a JSON object")
    serve.add_argument("--device", type=device, default="auto", help="auto (a GPU when visible), cpu or cuda[:N]")
    serve.add_argument("--tp", type=positive_int, default=1,
                       help="tensor-parallel ranks: GPUs (NCCL) from --device on, or gloo processes on CPU")
    serve.add_argument("--decode-steps", type=positive_int, default=1,
                       help="decode steps run back to back on the device per schedule (deltas of up to N tokens)")
    serve.add_argument("--no-warmup", action="store_true",
                       help="start without the warm-up prefill that compiles the GPU kernels before the first "
                            "request (default on a GPU at one rank: warm up)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=positive_int,
                      help="KV pool size in pages of 16 tokens (default: sized from --kv-cache-memory)")
    pool.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                      help="KV pool byte budget, e.g. 2GiB (default: 512MiB on CPU; on a GPU what 90%% of its "
                           "memory leaves after the weights)")
    serve.add_argument("--chain-host-memory", type=byte_size, metavar="SIZE",
                       help="host memory for idle chains' KV under pressure, e.g. 8GiB: their next turn loads it "
                            "back instead of recomputing (default: off)")
    serve.add_argument("--chain-disk", nargs=2, metavar=("DIR", "SIZE"),
                       help="a directory and a byte budget for chains the host tier moves down (needs "
                            "--chain-host-memory)")
    scale = serve.add_argument_group("scale-out on Ray Serve (docs/scale-out.md)")
    scale.add_argument("--replicas", type=positive_int, metavar="N",
                       help="run N engine replicas on Ray Serve, a chain's turns routed to the replica holding it "
                            "(default: one engine in this process)")
    scale.add_argument("--http-replicas", type=positive_int, default=1, metavar="M",
                       help="HTTP replicas in front of the engine replicas (with --replicas)")
    scale.add_argument("--no-affinity", dest="affinity", action="store_false",
                       help="route engine requests at random instead of to the chain's owner (a baseline)")
    scale.add_argument("--engine-cpus", type=float, default=1.0, help="Ray CPUs per engine replica")
    scale.add_argument("--engine-gpus", type=float, default=0.0, help="Ray GPUs per engine replica")
    scale.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray instance)")
    serve.add_argument("--require-auth", dest="require_auth", action="store_true", default=None,
                       help="require API keys (the default unless --host is a loopback address)")
    serve.add_argument("--no-auth", dest="require_auth", action="store_false",
                       help="serve without API keys (only allowed on a loopback --host)")
    serve.add_argument("--max-body-size", type=positive_int, default=8 * 2**20, help="bytes per request body")
    serve.add_argument("--max-tokens-per-turn", type=positive_int, default=4096,
                       help="the largest sampling.max_tokens")
    serve.add_argument("--max-chains-per-tenant", type=non_negative_int, default=1000, help="0: unlimited")
    serve.add_argument("--max-queue-depth", type=non_negative_int, default=256,
                       help="engine requests in flight before new ones get 503 (0: unbounded)")
    serve.add_argument("--max-method-configs-per-tenant", type=non_negative_int, default=4,
                       help="distinct method configurations one tenant's chains may use at once (0: unlimited)")
    serve.add_argument("--no-implicit-chains", dest="implicit_chains", action="store_false",
                       help="chat completions without chain_id run stateless (prefix caching only) instead of "
                            "resuming the tenant's chain that holds the conversation")
    serve.add_argument("--tool-call-syntax", choices=sorted(SYNTAXES), default=None,
                       help="how the model spells tool calls (default: what its chat template shows; docs/server.md)")
    serve.add_argument("--allowed-host", action="append", metavar="NAME",
                       help="a Host name the server answers to (repeatable; '*.example.com' for subdomains, '*' for "
                            "any); default: loopback names without API keys, any name with them")

    keys = sub.add_parser("keys", help="manage API keys (create / list / revoke)",
                          description="API keys of the server's database (docs/server.md, Auth).")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    for name, text in (("create", "create a key for a tenant; prints the key once"), ("list", "list keys"),
                       ("revoke", "revoke a key by its id")):
        p = keys_sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("--db", type=db_url, help=DB_HELP)
        if name == "create":
            p.add_argument("--tenant", required=True, help="the tenant the key acts for")
            p.add_argument("--name", help="a label for the key")
        elif name == "list":
            p.add_argument("--tenant", help="only this tenant's keys (default: every tenant's)")
        else:
            p.add_argument("key_id", help="the key's id, as `agentrt keys list` prints it")

    demo = sub.add_parser("demo", help="a scripted 8-turn tool-using agent session with a lag-2 pruning policy",
                          description="A scripted 8-turn tool-using agent session with a lag-2 pruning policy,\n"
                                      "through the SDK: a table row per turn, and a legend.")
    demo.add_argument("--url", type=http_url, help="an agentrt server to talk to (default: start one in-process)")
    demo.add_argument("--max-tokens", type=positive_int, default=16, help="tokens generated per turn")
    return ap


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
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "keys":
        return _keys(args)
    return _generate(args)


if __name__ == "__main__":
    raise SystemExit(main())
