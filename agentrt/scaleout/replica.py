"""One engine replica as a Ray Serve deployment: the engine on its worker thread (agentrt.engine_worker), reached by
the HTTP replicas through deployment-handle calls (agentrt.scaleout.remote_engine).

Every method takes ``replica`` and ``prefix`` keyword arguments it does not use: they are what the request
router (agentrt.scaleout.router) reads to choose the replica. The replica writes its load to the database every
``heartbeat_s`` (agentrt.scaleout.registry), for ``/metrics`` on whichever HTTP replica is asked, and reports the
same to the routers (``record_routing_stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from agentrt.config import ServerConfig, default_db_url
from agentrt.db import open_database
from agentrt.engine_worker import EngineWorker
from agentrt.scaleout import registry

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine_handle import EngineHandle
    from engine.model_config import ModelConfig
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class MethodName:
    name: str


@dataclass(slots=True, frozen=True)
class EngineFacts:
    """What the server reads of its engine besides calls (engine.engine_handle.EngineHandle's fixed attributes),
    sent once to each HTTP replica: every engine replica is built from the same configuration."""

    config: EngineConfig
    model_config: ModelConfig
    method: MethodName
    max_model_len: int


class EngineReplica:
    async def __init__(self, config: ServerConfig, heartbeat_s: float = 1.0):
        from ray import serve

        from agentrt.app import GIL_SWITCH_INTERVAL_S, build_engine

        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        _bound_threads()
        # as in the single-process server (agentrt.app): the event loop, which streams outputs to the HTTP
        # replicas and writes the heartbeat, must not wait out 5 ms GIL slices behind the engine thread
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        disk = config.engine_options.get("chain_disk_dir")
        self.handoff = HandoffDirs(Path(disk), self.replica_id) if disk is not None else None
        if self.handoff is not None:  # each replica's disk tier is its own: two engines must not adopt one file
            config = dataclasses.replace(config, engine_options={**config.engine_options,
                                                                 "chain_disk_dir": str(self.handoff.own)})
        engine = await anyio.to_thread.run_sync(build_engine, config)
        self.facts_ = EngineFacts(engine.config, engine.model_config, MethodName(engine.method.name),
                                  engine.max_model_len)
        self.worker = EngineWorker(engine, max_queue_depth=config.max_queue_depth, retry_after_s=config.retry_after_s)
        self.worker.start()
        self.db = await open_database(config.db_url or default_db_url())
        self.heartbeat_s = heartbeat_s
        self.started_at = time.time()
        await registry.beat(self.db, self.replica_id, self.started_at, self.stats())
        self._heartbeat = asyncio.ensure_future(self._beat())
        log.info("engine replica %s serving %s (pid %d)", self.replica_id, engine.config.model, os.getpid())

    # --- routing --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = self.worker.snapshot
        return {"pages_free": s.pages_free, "num_pages": s.num_pages, "requests": s.num_requests,
                "tier_host_bytes": s.tier_bytes[0], "tier_disk_bytes": s.tier_bytes[1], "pid": os.getpid()}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await registry.beat(self.db, self.replica_id, self.started_at, self.stats())
            except Exception:  # noqa: BLE001 -- a missed beat; the next one may land
                log.exception("heartbeat of %s failed", self.replica_id)

    # --- calls from the HTTP replicas -----------------------------------------------------------
    async def facts(self, replica: str | None = None, prefix: str | None = None) -> EngineFacts:
        return self.facts_

    async def generate(self, prompt: list[int], params: SamplingParams, chain_id: str | None = None,
                       method: tuple[str, dict] | None = None, replica: str | None = None,
                       prefix: str | None = None) -> AsyncGenerator[str | RequestOutput, None]:
        """This replica's id, then the request's outputs. Raises what EngineWorker.submit raises before the
        first item; a caller that stops early (cancels) aborts the request."""
        if chain_id is not None:
            await self._claim(chain_id)
        stream = await self.worker.submit(prompt, params, chain_id=chain_id, method=method)
        yield self.replica_id
        async for out in stream.outputs():
            yield out

    async def call(self, fn: Callable[[EngineHandle], Any], chain: str | None = None, replica: str | None = None,
                   prefix: str | None = None) -> tuple[str, Any]:
        """(this replica's id, ``fn(engine)`` run on the engine's thread)."""
        if chain is not None:
            await self._claim(chain)
        return self.replica_id, await self.worker.call(fn)

    async def _claim(self, chain_id: str) -> None:
        """A chain that another replica handed off (drained) or left on disk (died) becomes this engine's: its
        next turn loads it instead of recomputing its history."""
        if self.handoff is None:
            return
        path = await self.handoff.find(chain_id, self.db)
        if path is not None and await self.worker.call(lambda e: e.adopt_chain(str(path))):
            log.info("chain %s taken over from %s", chain_id, path.parent.name)

    async def __del__(self) -> None:
        """Drain (scale-down, upgrade, shutdown): in-flight requests fail with a retryable error, idle chains go to
        the disk tier when the engine has one, and the heartbeat row goes, so no router waits on this replica."""
        self._heartbeat.cancel()
        await anyio.to_thread.run_sync(self.worker.stop)
        if self.handoff is not None:
            moved = self.handoff.hand_off()
            log.info("engine replica %s drained: %d chain(s) handed off", self.replica_id, moved)
        try:
            await registry.leave(self.db, self.replica_id)
        finally:
            await self.db.dispose()


def _bound_threads() -> None:
    """torch's intra-op threads to the CPUs Ray gave this replica: replicas sharing a machine would otherwise
    each start one thread per core and slow each other down."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus:
        torch.set_num_threads(max(1, int(cpus)))


class HandoffDirs:
    """The replicas' disk tiers under one shared directory: ``replicas/<id>/`` is each replica's own tier;
    ``handoff/`` holds the chains of drained replicas until the replica their next turn reaches claims them (by
    moving the file into its own tier: one claim wins). A replica that died leaves its directory: once its
    heartbeat is stale (agentrt.scaleout.registry) its files are claimed the same way."""

    def __init__(self, root: Path, replica_id: str):
        self.root = root
        self.own = root / "replicas" / replica_id
        self.shared = root / "handoff"
        self.shared.mkdir(parents=True, exist_ok=True)

    async def find(self, chain_id: str, db: Any) -> Path | None:
        from engine.chain_tiers import chain_file_name

        name = chain_file_name(chain_id)
        if (self.shared / name).exists():
            return self.shared / name
        left = [p for p in (self.root / "replicas").glob(f"*/{name}") if p.parent != self.own]
        if not left:
            return None
        alive = await registry.live(db)
        return next((p for p in left if p.parent.name not in alive), None)

    def hand_off(self) -> int:
        moved = 0
        for path in self.own.glob("*.safetensors"):
            os.replace(path, self.shared / path.name)
            moved += 1
        with contextlib.suppress(OSError):
            for stale in self.own.iterdir():
                stale.unlink()
            self.own.rmdir()
        return moved
