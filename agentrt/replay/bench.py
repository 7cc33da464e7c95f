"""The replay benchmark: for each configuration, start an in-process server on the model, warm it up (a short
request, then the first trace alone under its own system prompt: ``warm_up_trace``), replay the traces with N
concurrent sessions, stop the server; then report (JSON, table, plots)."""

from __future__ import annotations

import asyncio
import gc
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from agentrt.replay.replayer import ReplayConfig, Replayer, RunResult
from agentrt.replay.trace import Trace


TIER_HOST_BYTES = 64 * 2**30  # the host tier of the ``-tiers`` configurations


def standard_configs(snapkv_config: dict[str, Any] | None = None,
                     lag_policy: dict[str, Any] | None = None) -> dict[str, ReplayConfig]:
    """The named configurations (``agentrt replay run --configs``); ``-tiers``: idle chains reclaimed under
    pressure move to host memory and load back instead of recomputing (engine.chain_tiers)."""
    tiers = {"chain_host_bytes": TIER_HOST_BYTES}
    return {c.name: c for c in [
        ReplayConfig("dense-noprefix", "stateless", prefix_cache=False),
        ReplayConfig("dense-prefix", "stateless"),
        ReplayConfig("dense-chain", "chain"),
        ReplayConfig("dense-chain-lag", "chain", prune_policy=lag_policy or {"lag": 2}),
        ReplayConfig("snapkv-chain", "chain", method="snapkv", method_config=snapkv_config or {}),
        ReplayConfig("snapkv-chain-lag", "chain", method="snapkv", method_config=snapkv_config or {},
                     prune_policy=lag_policy or {"lag": 2}),
        ReplayConfig("dense-chain-tiers", "chain", engine_options=tiers),
        ReplayConfig("snapkv-chain-tiers", "chain", method="snapkv", method_config=snapkv_config or {},
                     engine_options=tiers),
        ReplayConfig("snapkv-chain-lag-tiers", "chain", method="snapkv", method_config=snapkv_config or {},
                     prune_policy=lag_policy or {"lag": 2}, engine_options=tiers),
    ]}


def serve_and_replay(traces: list[Trace], config: ReplayConfig, *, model: str | Path | None = None,
                     engine_options: dict[str, Any] | None = None, think_scale: float = 1.0,
                     sample_interval_s: float = 0.05) -> RunResult:
    """Start a server for ``config`` (``model`` None: the embedded tiny model), replay, stop it."""
    from agentrt.config import ServerConfig

    longest = max(len(t.output_token_ids) for trace in traces for t in trace.turns)
    with tempfile.TemporaryDirectory(prefix="agentrt-replay-") as tmp:
        server_config = ServerConfig(
            model=model, model_name="replay", db_url=f"sqlite+aiosqlite:///{Path(tmp) / 'replay.db'}",
            method=config.method, method_config=dict(config.method_config),
            engine_options={**(engine_options or {}), **config.engine_options,
                            "enable_prefix_caching": config.prefix_cache},
            max_tokens_per_turn=max(4096, longest), max_chains_per_tenant=None, max_queue_depth=None,
            max_body_size=256 * 2**20,
            implicit_chains=False)  # the stateless configurations stand for clients that get no chain at all
        try:
            return _replay_on_server(server_config, traces, config, think_scale, sample_interval_s)
        finally:
            _release_memory()  # the engine of this configuration is unreachable now: free its GPU memory


def _replay_on_server(server_config: Any, traces: list[Trace], config: ReplayConfig, think_scale: float,
                      sample_interval_s: float) -> RunResult:
    from agentrt.app import build_engine, create_app
    from agentrt.local_server import LocalServer

    with LocalServer(create_app(server_config, engine=build_engine(server_config))) as server:
        _warm_up(server.url)
        warm = warm_up_trace(traces[0])
        if warm is not None:  # the configuration's own paths (chain turns, a method's vote) compiled before timing
            asyncio.run(Replayer(server.url, "replay", think_scale=0.0).run([warm], config))
        replayer = Replayer(server.url, "replay", think_scale=think_scale, sample_interval_s=sample_interval_s)
        return asyncio.run(replayer.run(traces, config))


WARM_UP_MARK = "(warm-up run) "


def warm_up_trace(trace: Trace) -> Trace | None:
    """The session replayed once before the timed run, alone and without think time: ``trace`` without its last
    turn (so it fits wherever ``trace`` does, with the mark's few tokens), under a system prompt no timed session
    shares, so nothing it leaves in the prefix cache serves a timed turn. What the first turns of a configuration
    pay once per process (Triton compiling the kernels of its paths: a chain's turns, a method's vote and
    compaction over a long prompt) is then paid here. None for a one-turn trace."""
    if trace.num_turns < 2:
        return None
    header = msgspec.structs.replace(trace.header, trace_id=f"{trace.header.trace_id}-warm-up",
                                     system_prompt=WARM_UP_MARK + trace.header.system_prompt)
    return Trace(header=header, turns=trace.turns[:-1])


def run_all(traces: list[Trace], configs: list[ReplayConfig], log: Callable[[str], None] = print,
            on_result: Callable[[RunResult], None] | None = None, repeats: int = 1, **kw: Any) -> list[RunResult]:
    """Replay every configuration in turn, ``repeats`` rounds of all of them (a configuration's runs are spread
    over the whole time, so drift of the machine does not fall on one of them); ``on_result`` sees each result as
    soon as its run ends."""
    results = []
    for round_ in range(repeats):
        for config in configs:
            of = f", run {round_ + 1} of {repeats}" if repeats > 1 else ""
            log(f"replay: {config.name} ({len(traces)} sessions, {sum(t.num_turns for t in traces)} turns{of})")
            results.append(serve_and_replay(traces, config, **kw))
            log(f"replay: {config.name} done in {results[-1].wall_s:.2f} s")
            if on_result is not None:
                on_result(results[-1])
    return results


def _warm_up(url: str) -> None:
    """One short request before timing (the first request's compilation and first-call costs stay out of the
    numbers; ``warm_up_trace`` then runs the configuration's own paths)."""
    import httpx

    body = {"model": "replay", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4,
            "temperature": 0.0}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()


def _release_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
