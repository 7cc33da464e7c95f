"""Agent sessions across engine replicas on Ray Serve: turn latency, errors and recomputes, against one replica.

    python -m benchmarks.scaleout --chains 64 --turns 20 --out /tmp/scaleout.json
    python -m benchmarks.scaleout --configs single,ray1,ray2,ray2-random --chains 16 --turns 6

Configurations (each on a fresh database, one after another):
- ``single``: ``agentrt serve`` in one process (no Ray): the engine the other configurations scale out;
- ``rayN``: N engine replicas and ``--http-replicas`` HTTP replicas on a local Ray instance, chain affinity on;
- ``rayN-random``: the same, engine replicas picked at random (a chain-unaware router).

Each configuration runs ``--chains`` sessions at once, each ``--turns`` turns one after another through the HTTP
API (a short user message, ``--max-tokens`` greedy tokens). Timed: from the first turn's request to the last
turn's response; excluded: server start, one warm-up chain, chain creation. Per configuration: turns, errors
(any non-200), turn latency p50 / p99 (client side), turns per second, prompt tokens prefilled, turns that
recomputed their chain. A table on stdout; ``--out`` writes it as JSON with the settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = ("falcon otter river stone maple cedar harbor lantern copper meadow signal thunder orchard "
         "glacier ember willow canyon beacon").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, replicas: int | None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/metrics", timeout=5)
            if r.status_code == 200 and (replicas is None or f"agentrt_replicas {replicas}.0" in r.text):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


async def _session(c: httpx.AsyncClient, rng: random.Random, turns: int, max_tokens: int, out: dict) -> None:
    r = await c.post("/v1/chains", json={})
    if r.status_code != 201:
        out["errors"] += turns
        out["error_samples"].append(f"{r.status_code} {r.text[:300]}")
        return
    cid = r.json()["id"]
    for _ in range(turns):
        text = " ".join(rng.choice(WORDS) for _ in range(6))
        t0 = time.perf_counter()
        r = await c.post(f"/v1/chains/{cid}/turns", json={
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens},
            "messages": [{"role": "user", "content": text}]})
        out["latency"].append(time.perf_counter() - t0)
        if r.status_code != 200:
            out["errors"] += 1
            out["error_samples"].append(f"{r.status_code} {r.text[:300]}")
            continue
        body = r.json()
        out["prefilled"] += body["usage"]["prefilled_tokens"]
        out["recomputed"] += body["resume_status"] == "recomputed"


async def _drive(url: str, chains: int, turns: int, max_tokens: int, seed: int) -> dict:
    out = {"latency": [], "errors": 0, "prefilled": 0, "recomputed": 0, "error_samples": []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await _session(c, random.Random(-1), 1, max_tokens, {"latency": [], "errors": 0, "prefilled": 0,
                                                              "recomputed": 0, "error_samples": []})  # warm-up, not counted
        t0 = time.perf_counter()
        await asyncio.gather(*(_session(c, random.Random(seed + i), turns, max_tokens, out) for i in range(chains)))
        out["seconds"] = time.perf_counter() - t0
    return out


def _summary(name: str, raw: dict) -> dict:
    lat = sorted(raw["latency"])
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    return {"config": name, "turns": len(lat), "errors": raw["errors"],
            "p50_s": statistics.median(lat) if lat else float("nan"), "p99_s": p99,
            "turns_per_s": len(lat) / raw["seconds"], "seconds": raw["seconds"], "prefilled_tokens": raw["prefilled"],
            "recomputed_turns": raw["recomputed"], "error_samples": sorted(set(raw["error_samples"]))[:5]}


def _run_single(args: argparse.Namespace, db: str) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / "scaleout-single.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--db", db,
                             "--device", "cpu", "--num-pages", str(args.num_pages)], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait(url, None)
        return asyncio.run(_drive(url, args.chains, args.turns, args.max_tokens, args.seed))
    finally:
        proc.terminate()
        proc.wait(30)


def _run_ray(args: argparse.Namespace, db: str, replicas: int, affinity: bool) -> dict:
    from ray import serve

    from agentrt.config import ServerConfig
    from agentrt.scaleout.deploy import APP_NAME, ScaleOut, build_application

    config = ServerConfig(db_url=db, engine_options={"device": "cpu", "num_pages": args.num_pages})
    serve.run(build_application(config, ScaleOut(replicas=replicas, http_replicas=args.http_replicas,
                                                 affinity=affinity, engine_cpus=args.engine_cpus)),
              name=APP_NAME, route_prefix="/")
    try:
        _wait(args.url, replicas)
        return asyncio.run(_drive(args.url, args.chains, args.turns, args.max_tokens, args.seed))
    finally:
        serve.delete(APP_NAME)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="single,ray1,ray2,ray2-random")
    p.add_argument("--chains", type=int, default=64)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--http-replicas", type=int, default=2)
    p.add_argument("--engine-cpus", type=float, default=1.0, help="Ray CPUs (and torch threads) per engine replica")
    p.add_argument("--num-pages", type=int, default=2048, help="KV pages per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    configs = args.configs.split(",")
    results = []
    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    ray_up = False
    for i, name in enumerate(configs):
        db = f"sqlite+aiosqlite:///{work / f'{i}-{name}.db'}"
        if name == "single":
            raw = _run_single(args, db)
        else:
            if not ray_up:
                import ray
                from ray import serve

                from agentrt.scaleout.deploy import ScaleOut, local_cpus

                most = max(int(n.removeprefix("ray").removesuffix("-random")) for n in configs if n != "single")
                need = local_cpus(ScaleOut(replicas=most, http_replicas=args.http_replicas,
                                           engine_cpus=args.engine_cpus))
                ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                         log_to_driver=False)
                port = _free_port()
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                args.url, ray_up = f"http://127.0.0.1:{port}", True
            replicas = int(name.removeprefix("ray").removesuffix("-random"))
            raw = _run_ray(args, db, replicas, affinity=not name.endswith("-random"))
        results.append(_summary(name, raw))
        r = results[-1]
        print(f"{name}: {r['turns']} turns, {r['errors']} errors, p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s",
              flush=True)
    if ray_up:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    print("\n| config | turns | errors | p50 s | p99 s | turns/s | prefilled tokens | recomputed turns |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r['turns']} | {r['errors']} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | "
              f"{r['turns_per_s']:.1f} | {r['prefilled_tokens']} | {r['recomputed_turns']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
