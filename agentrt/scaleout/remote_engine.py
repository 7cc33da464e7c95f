"""The HTTP replica's engine: the EngineWorker interface the routes use (``call``, ``submit``, ``abort``,
``snapshot``, ``engine``), over a Ray Serve deployment handle to the engine replicas.

A call about a chain is routed to the chain's owner (read from the chain leases); a generation request to the
owner, or by prefix affinity when it has no chain (agentrt.scaleout.router). An error the engine raised comes back
as itself (not wrapped), so the routes answer it exactly as in one process; a replica lost mid-request (its process
died, it was drained) is ``ReplicaLost``, a 503 with Retry-After: nothing of the turn was written, and the retry
runs on a live replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError

from agentrt.db import Database
from agentrt.engine_worker import EngineOverloaded, EngineSnapshot, EngineUnavailable
from agentrt.scaleout import registry
from agentrt.scaleout.leases import ChainLeases
from agentrt.scaleout.router import prefix_key

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

    from agentrt.scaleout.replica import EngineFacts
    from engine.engine_handle import EngineHandle
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class ReplicaLost(EngineUnavailable):
    """The engine replica running the request is gone; retry (the chain continues on another replica)."""

    retry_after = 1


def _reraise(exc: BaseException) -> NoReturn:
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        raise exc.cause from None  # the engine's own exception, as in one process
    if isinstance(exc, (RayActorError, DeploymentUnavailableError)):
        raise ReplicaLost(f"the engine replica was lost: {type(exc).__name__}; retry the request") from None
    raise exc


class RemoteStream:
    """A generation request on an engine replica (agentrt.engine_worker.RequestStream's interface); ``replica``
    is the engine replica running it."""

    def __init__(self, worker: RemoteEngine, request_id: str, gen: DeploymentResponseGenerator, replica: str):
        self.worker = worker
        self.request_id = request_id
        self.gen = gen
        self.replica = replica
        self.done = False

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while not self.done:
                try:
                    item = await self.gen.__anext__()
                except StopAsyncIteration:
                    raise ReplicaLost("the engine replica ended the request before it finished") from None
                except (RayTaskError, RayActorError, DeploymentUnavailableError) as exc:
                    self.done = True
                    _reraise(exc)
                self.done = item.finished
                yield item
        finally:
            self.worker._forget(self.request_id)
            if not self.done:
                self.done = True
                self.gen.cancel()


class RemoteEngine:
    def __init__(self, handle: DeploymentHandle, db: Database, leases: ChainLeases | None,
                 max_queue_depth: int | None = None, retry_after_s: int = 2, poll_s: float = 1.0):
        """``leases``: where chains are (None: no chain has an owner, every request goes by load)."""
        self.handle = handle
        self.db = db
        self.leases = leases
        self.max_queue_depth = max_queue_depth
        self.retry_after_s = retry_after_s
        self.poll_s = poll_s
        self.engine: EngineFacts | None = None
        self.snapshot = EngineSnapshot()
        self.replicas: dict[str, dict[str, Any]] = {}  # live engine replicas' last reported load
        self.inflight: set[str] = set()
        self.on_step: Callable | None = None  # steps run on the engine replicas; their timings stay there
        self._streams: dict[str, RemoteStream] = {}
        self._poll: asyncio.Task | None = None

    async def start(self) -> None:
        try:
            self.engine = await self.handle.facts.remote()
        except (RayTaskError, RayActorError, DeploymentUnavailableError) as exc:
            _reraise(exc)
        await self._refresh()
        self._poll = asyncio.ensure_future(self._polling())

    def stop(self, timeout: float = 10.0) -> None:
        if self._poll is not None:
            self._poll.cancel()
        for stream in list(self._streams.values()):
            stream.gen.cancel()

    async def _polling(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self._refresh()
            except Exception:  # noqa: BLE001 -- a missed read; the gauges keep their last values
                log.exception("reading the engine replicas' heartbeats failed")

    async def _refresh(self) -> None:
        self.replicas = await registry.live(self.db)
        stats = self.replicas.values()
        self.snapshot = EngineSnapshot(sum(s.get("num_pages", 0) for s in stats),
                                       sum(s.get("pages_free", 0) for s in stats),
                                       sum(s.get("requests", 0) for s in stats), None,
                                       (sum(s.get("tier_host_bytes", 0) for s in stats),
                                        sum(s.get("tier_disk_bytes", 0) for s in stats)))

    async def _owner(self, chain_id: str | None) -> str | None:
        return None if chain_id is None or self.leases is None else await self.leases.owner(chain_id)

    async def call(self, fn: Callable[[EngineHandle], T], chain: str | None = None) -> T:
        """``fn(engine)`` on the engine replica that owns ``chain`` (any replica for None)."""
        owner = await self._owner(chain)
        try:
            _replica, result = await self.handle.call.remote(fn, chain=chain, replica=owner)
        except (RayTaskError, RayActorError, DeploymentUnavailableError) as exc:
            _reraise(exc)
        return result

    async def submit(self, prompt: list[int], params: SamplingParams, chain_id: str | None = None,
                     method: tuple[str, dict] | None = None) -> RemoteStream:
        if self.max_queue_depth is not None and len(self.inflight) >= self.max_queue_depth:
            raise EngineOverloaded(len(self.inflight), self.max_queue_depth, self.retry_after_s)
        owner = await self._owner(chain_id)
        request_id = f"req-{uuid.uuid4().hex}"
        gen = self.handle.options(stream=True).generate.remote(
            prompt, params, chain_id=chain_id, method=method, replica=owner,
            prefix=prefix_key(prompt) if chain_id is None else None)
        self.inflight.add(request_id)
        try:
            replica = await gen.__anext__()
        except BaseException as exc:
            self.inflight.discard(request_id)
            if isinstance(exc, (RayTaskError, RayActorError, DeploymentUnavailableError)):
                _reraise(exc)
            with contextlib.suppress(Exception):
                gen.cancel()
            raise
        stream = self._streams[request_id] = RemoteStream(self, request_id, gen, replica)
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        self._forget(request_id)
        if stream is not None:
            stream.done = True
            stream.gen.cancel()

    def _forget(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        self._streams.pop(request_id, None)

