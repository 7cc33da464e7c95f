"""Server memory under repeated load: resident memory of an ``agentrt serve`` process after each round of chains.

    python -m benchmarks.server_memory --rounds 10 --chains 64 --turns 20 --out /tmp/server_memory.json
    python -m benchmarks.server_memory --rounds 10 --env MALLOC_ARENA_MAX=2 --label arena2
    python -m benchmarks.server_memory --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 --env LRU_CACHE_CAPACITY=1024
    python -m benchmarks.server_memory --rounds 10 --trim --label trim     # malloc_trim(0) after each round
    python -m benchmarks.server_memory --rounds 4 -- --kv-cache-memory 64MiB   # after --: more serve flags

Each round runs ``--chains`` chains concurrently, each ``--turns`` turns one after another through the HTTP API
(POST /v1/chains, POST /v1/chains/{id}/turns, DELETE /v1/chains/{id}); when every chain of the round is deleted
and the server has settled, the server process is measured: its RSS (and the anonymous part) from
/proc/PID/status, and, from inside the server (``SIGUSR1``, answered by the bootstrap below, which then runs
``agentrt serve`` itself), the resident part of the KV pool, Python's view (pymalloc blocks, gc-tracked
objects), glibc malloc's view (``mallinfo2``: bytes in use, free bytes kept in the arenas, mmapped bytes; the
number of arenas) and the server's per-chain and per-request containers (engine chains, requests,
detokenizers, streams, chain states), which must be empty between rounds. ``--plain`` runs the ``agentrt``
executable instead (RSS only).

A table per round on stdout; ``--out`` writes it as JSON with the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 2**20
WORDS = ("falcon otter river stone maple cedar harbor lantern copper meadow signal thunder orchard "
         "glacier ember willow canyon beacon").split()


# --- the server side ------------------------------------------------------------------------------------
def mapping_rss(address: int, size: int) -> int:
    """Resident bytes of the memory mappings that overlap ``[address, address + size)`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + size and address < hi
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def _server_view() -> dict:
    """What the server holds, seen from inside: called on the server's main thread (a signal handler)."""
    from agentrt.native_memory import malloc_arenas, malloc_stats

    gc.collect()
    view: dict = {"py_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects()),
                  "threads": len(os.listdir("/proc/self/task")), "malloc": malloc_stats(),
                  "malloc_arenas": malloc_arenas()}
    wanted = {"LLMEngine", "ChainService", "EngineWorker"}
    found = {}
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in wanted and name not in found:
            found[name] = obj
    counts: dict[str, int] = {}
    engine = found.get("LLMEngine")
    if engine is not None:
        counts.update(engine_chains=len(engine.chains.index), engine_requests=len(engine._requests),
                      engine_detokenizers=len(engine._detokenizers),
                      prune_results=len(engine.chains._prune_results), deferred_prunes=len(engine.chains._deferred),
                      pages_free=engine.pool.num_free, pages=engine.pool.num_pages)
        kv = getattr(engine.cache, "kv", None)
        if kv is not None and kv.device.type == "cpu":
            view["kv_resident"] = mapping_rss(kv.data_ptr(), kv.numel() * kv.element_size())
        index = getattr(engine.cache, "prefix_index", None) or getattr(engine.cache, "index", None)
        if index is not None and hasattr(index, "__len__"):
            counts["prefix_entries"] = len(index)
    service = found.get("ChainService")
    if service is not None:
        counts.update(service_states=len(service.states), service_busy=len(service.busy))
    worker = found.get("EngineWorker")
    if worker is not None:
        counts.update(worker_streams=len(worker._streams), worker_inflight=len(worker.inflight))
    import torch

    counts["torch_generators"] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Generator))
    view["counts"] = counts
    return view


def _serve_child(argv: list[str]) -> int:
    """``_serve --stats FILE -- serve ...``: answer SIGUSR1 (write the server's view to FILE) and SIGUSR2
    (``malloc_trim(0)`` first), then run the ``agentrt`` command line with the rest."""
    ap = argparse.ArgumentParser(prog="server_memory _serve")
    ap.add_argument("--stats", required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest

    def report(signum, frame) -> None:
        from agentrt.native_memory import malloc_trim

        view = {}
        if signum == signal.SIGUSR2:
            t0 = time.perf_counter()
            view["trim_released"] = malloc_trim()
            view["trim_s"] = time.perf_counter() - t0
        view.update(_server_view())
        tmp = f"{args.stats}.tmp"
        Path(tmp).write_text(json.dumps(view))
        os.replace(tmp, args.stats)

    signal.signal(signal.SIGUSR1, report)
    signal.signal(signal.SIGUSR2, report)
    from agentrt.cli import main

    return main(rest)


# --- the client side ------------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats = workdir / "stats.json"
        db = f"sqlite+aiosqlite:///{workdir / 'server.db'}"
        serve = ["serve", "--port", str(self.port), "--device", "cpu", "--db", db, *args.serve_args]
        if args.plain:
            cmd = [shutil.which("agentrt") or "agentrt", *serve]
        else:
            cmd = [sys.executable, "-m", "benchmarks.server_memory", "_serve", "--stats", str(self.stats), "--",
                   *serve]
        env = dict(os.environ)
        for item in args.env:
            key, _, value = item.partition("=")
            env[key] = value
        self.plain = args.plain
        self.log = open(workdir / "server.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1])

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start in time")

    def view(self, trim: bool = False, timeout: float = 120.0) -> dict:
        """The server's own view (empty with --plain); with ``trim``, taken right after ``malloc_trim(0)``."""
        if self.plain:
            return {}
        self.stats.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR2 if trim else signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not self.stats.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server did not report its memory")
            time.sleep(0.05)
        return json.loads(self.stats.read_text())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def run_chain(client, rng: random.Random, args, rnd: int, idx: int) -> int:
    r = await client.post("/v1/chains", json={"system_prompt": f"You are agent {idx} of round {rnd}."})
    r.raise_for_status()
    cid = r.json()["id"]
    for turn in range(args.turns):
        words = " ".join(rng.choice(WORDS) for _ in range(args.user_words))
        body = {"messages": [{"role": "user", "content": f"Turn {turn}: the number for {words} is "
                                                          f"{rng.randrange(10**5)}. What is it?"}],
                "sampling": {"max_tokens": args.max_tokens, "temperature": args.temperature}}
        r = await client.post(f"/v1/chains/{cid}/turns", json=body)
        r.raise_for_status()
    r = await client.delete(f"/v1/chains/{cid}")
    if r.status_code != 204:
        raise RuntimeError(f"DELETE {cid}: {r.status_code} {r.text}")
    return args.turns


async def run_round(url: str, args, rnd: int) -> int:
    import httpx

    rng = random.Random(args.seed * 1000 + rnd)
    limits = httpx.Limits(max_connections=args.chains + 4, max_keepalive_connections=args.chains + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        done = await asyncio.gather(*(run_chain(client, random.Random(rng.random()), args, rnd, i)
                                      for i in range(args.chains)))
    return sum(done)


def row_of(rnd: int, seconds: float, turns: int, status: dict, view: dict, trimmed: dict | None) -> dict:
    row = {"round": rnd, "seconds": round(seconds, 1), "turns": turns, "rss_mb": status["VmRSS"] / MB,
           "rss_anon_mb": status["RssAnon"] / MB, "rss_file_mb": status["RssFile"] / MB,
           "hwm_mb": status["VmHWM"] / MB}
    if view:
        row.update(kv_resident_mb=view.get("kv_resident", 0) / MB, py_blocks=view["py_blocks"],
                   gc_objects=view["gc_objects"], threads=view["threads"], counts=view["counts"])
        m = view["malloc"]  # empty when malloc is not glibc's
        if m:
            row.update(malloc_in_use_mb=m["in_use"] / MB, malloc_free_mb=m["free"] / MB, malloc_mmap_mb=m["mmap"] / MB,
                       arenas=len(view["malloc_arenas"]), malloc_arena_detail=view["malloc_arenas"])
    if trimmed is not None:
        row["rss_after_trim_mb"] = trimmed["status"]["VmRSS"] / MB
        if trimmed["view"]:
            row["trim_s"] = trimmed["view"]["trim_s"]
            row["malloc_free_after_trim_mb"] = trimmed["view"]["malloc"].get("free", 0) / MB
    return row


def print_table(rows: list[dict], label: str) -> None:
    cols = [("round", 5, "{:>5}"), ("seconds", 7, "{:>7.1f}"), ("rss_mb", 8, "{:>8.0f}"),
            ("rss_anon_mb", 8, "{:>8.0f}"), ("rss_after_trim_mb", 9, "{:>9.0f}"), ("kv_resident_mb", 6, "{:>6.0f}"),
            ("malloc_in_use_mb", 8, "{:>8.0f}"), ("malloc_free_mb", 8, "{:>8.0f}"), ("malloc_mmap_mb", 7, "{:>7.0f}"),
            ("arenas", 6, "{:>6}"),
            ("threads", 7, "{:>7}"), ("py_blocks", 9, "{:>9}"), ("gc_objects", 9, "{:>9}")]
    heads = {"rss_mb": "RSS MB", "rss_anon_mb": "anon MB", "rss_after_trim_mb": "trimmed", "kv_resident_mb": "KV MB",
             "malloc_in_use_mb": "in use", "malloc_free_mb": "free", "malloc_mmap_mb": "mmap", "py_blocks": "py blocks",
             "gc_objects": "gc objs", "seconds": "secs"}
    present = [c for c in cols if any(c[0] in r for r in rows)]
    print(f"# {label}")
    print(" ".join(heads.get(c, c).rjust(w) for c, w, _ in present))
    for r in rows:
        print(" ".join(f.format(r[c]) if c in r else " " * w for c, w, f in present))
    last = rows[-1].get("counts")
    if last:
        print("after the last round:", " ".join(f"{k}={v}" for k, v in last.items()))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        raise SystemExit(_serve_child(argv[1:]))
    serve_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--chains", type=int, default=16, help="concurrent chains per round")
    ap.add_argument("--turns", type=int, default=8, help="turns per chain")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--user-words", type=int, default=6, help="random words in each user message")
    ap.add_argument("--settle", type=float, default=7.0,
                    help="seconds to wait after a round before measuring (the engine worker trims after 5 s idle)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="server environment")
    ap.add_argument("--trim", action="store_true", help="also measure right after malloc_trim(0) each round")
    ap.add_argument("--plain", action="store_true", help="run the agentrt executable: RSS only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--out", help="write the rows and settings as JSON here")
    args = ap.parse_args(argv)
    args.serve_args = serve_args
    workdir = Path(tempfile.mkdtemp(prefix="server_memory_"))
    server = Server(args, workdir)
    rows = []
    try:
        server.wait_ready()
        time.sleep(args.settle)
        start = {"status": proc_status(server.proc.pid), "view": server.view()}
        rows.append(row_of(0, 0.0, 0, start["status"], start["view"], None))
        for rnd in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            turns = asyncio.run(run_round(server.url, args, rnd))
            seconds = time.perf_counter() - t0
            time.sleep(args.settle)
            view = server.view()
            status = proc_status(server.proc.pid)
            trimmed = None
            if args.trim:
                tview = server.view(trim=True)
                trimmed = {"status": proc_status(server.proc.pid), "view": tview}
            rows.append(row_of(rnd, seconds, turns, status, view, trimmed))
            print(f"round {rnd}: {seconds:.1f} s, RSS {rows[-1]['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print_table(rows, args.label)
    result = {"label": args.label, "env": args.env, "serve_args": serve_args, "trim": args.trim,
              "rounds": args.rounds, "chains": args.chains, "turns": args.turns, "max_tokens": args.max_tokens,
              "user_words": args.user_words, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
