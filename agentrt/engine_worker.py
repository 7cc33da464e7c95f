"""The engine's step loop in its own thread, bridged to asyncio.

Only the worker thread touches the LLMEngine. The event loop sends commands through a thread-safe queue and
gets results back through ``loop.call_soon_threadsafe``: futures for one-shot calls, a per-request
asyncio.Queue of RequestOutputs for generation. Every request the engine holds is stepped in one
continuous batch, whichever chain or route it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from agentrt.native_memory import IdleTrimmer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine_handle import EngineHandle
    from engine.llm_engine import StepTiming

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class EngineSnapshot:
    num_pages: int = 0
    pages_free: int = 0
    num_requests: int = 0
    tiers: Any = None  # engine.chain_tiers.TierCounters (a copy), None when the engine has no chain tiers
    tier_bytes: tuple[int, int] = (0, 0)  # bytes held in the host and disk tiers

    @property
    def pages_used(self) -> int:
        return self.num_pages - self.pages_free


class EngineUnavailable(RuntimeError):
    """The worker thread is not running (not started yet, or shut down)."""


class EngineOverloaded(EngineUnavailable):
    """More requests in flight than the configured bound: the client should retry after ``retry_after`` s."""

    def __init__(self, depth: int, bound: int, retry_after: int):
        super().__init__(f"the engine is overloaded ({depth} requests in flight, the bound is {bound}); "
                         f"retry after {retry_after} s")
        self.retry_after = retry_after


class RequestStream:
    """The outputs of one engine request; leaving the iteration early aborts the request."""

    def __init__(self, worker: EngineWorker, request_id: str):
        self.worker = worker
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while not self.done:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                self.done = item.finished
                if self.done:
                    self.worker.inflight.discard(self.request_id)
                yield item
        finally:
            self.worker.inflight.discard(self.request_id)
            if not self.done:
                self.done = True
                self.worker.abort(self.request_id)


class EngineWorker:
    def __init__(self, engine: EngineHandle,
                 on_step: Callable[[float, list[RequestOutput], StepTiming | None], None] | None = None,
                 max_queue_depth: int | None = None, retry_after_s: int = 2, trim_idle_s: float | None = 5.0):
        """``trim_idle_s``: hand free C-heap memory back to the OS (``malloc_trim``) once the engine has had no
        work for that long after some (None: never); see agentrt.native_memory."""
        self.engine = engine
        self.trimmer = IdleTrimmer(trim_idle_s, enabled=None) if trim_idle_s is not None else None
        self.max_queue_depth = max_queue_depth  # None: unbounded
        self.retry_after_s = retry_after_s
        self.inflight: set[str] = set()  # event-loop side: generation requests submitted and not yet finished
        self.on_step = on_step
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # --- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        self._update_snapshot()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout)

    async def call(self, fn: Callable[[EngineHandle], T], chain: str | None = None) -> T:
        """Run ``fn(engine)`` on the worker thread and return its result (or raise its exception). ``chain``: the
        chain ``fn`` is about (one engine here holds them all; engine replicas route by it)."""
        if not self._thread.is_alive():
            raise EngineUnavailable("the engine worker is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                self._update_snapshot()
                loop.call_soon_threadsafe(_settle, fut, result, None)

        self._commands.put(run)
        return await fut

    async def submit(self, prompt: list[int], params: SamplingParams, chain_id: str | None = None,
                     method: tuple[str, dict] | None = None) -> RequestStream:
        """Queue a request (``method``: its (name, config), default the engine's); raises EngineOverloaded
        beyond ``max_queue_depth`` requests in flight, and what ``add_request`` raises
        (engine.errors.InvalidRequestError, ConfigError for a method the engine cannot serve...)."""
        if self.max_queue_depth is not None and len(self.inflight) >= self.max_queue_depth:
            raise EngineOverloaded(len(self.inflight), self.max_queue_depth, self.retry_after_s)
        stream = RequestStream(self, f"req-{uuid.uuid4().hex}")
        loop = asyncio.get_running_loop()
        name, config = method if method is not None else (None, None)

        def add(engine: EngineHandle) -> None:
            engine.add_request(prompt, params, request_id=stream.request_id, chain_id=chain_id, method=name,
                               method_config=config)
            self._streams[stream.request_id] = (loop, stream)

        self.inflight.add(stream.request_id)
        try:
            await self.call(add)
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            raise
        except BaseException:
            self.inflight.discard(stream.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self.inflight.discard(request_id)

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._commands.put(run)

    # --- worker thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            try:
                command = self._commands.get(timeout=1.0) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = _NOTHING
            while command is not _NOTHING:
                if command is None:
                    self._shutdown()
                    return
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = _NOTHING
            if self.engine.has_unfinished():
                self._step()
                if self.trimmer is not None:
                    self.trimmer.note_step()
            elif self.trimmer is not None:
                self.trimmer.maybe_trim()
            self._update_snapshot()

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug: fail every request in flight, keep serving
            log.exception("engine step failed")
            self._fail_all(exc)
            return
        if self.on_step is not None:
            self.on_step(time.perf_counter() - t0, outputs, self.engine.last_step)  # StepTiming, or None
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, (loop, stream) in streams.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                failure: list[tuple[RequestStream, RequestOutput | BaseException]] = [(stream, RuntimeError(f"engine: {exc}"))]
                loop.call_soon_threadsafe(_deliver, failure)

    def _shutdown(self) -> None:
        self._fail_all(RuntimeError("server shutting down"))
        persist = getattr(self.engine, "persist_chains", None)
        if persist is not None:  # idle chains to the disk tier, if there is one: the next server loads them
            try:
                persist()
            except Exception:
                log.exception("writing the idle chains to disk failed")

    def _update_snapshot(self) -> None:
        pool = self.engine.pool
        tiers = getattr(getattr(self.engine, "chains", None), "tiers", None)
        self.snapshot = EngineSnapshot(pool.num_pages, pool.num_free, len(self._streams),
                                       None if tiers is None else copy.deepcopy(tiers.counters),
                                       (0, 0) if tiers is None else (tiers.host_used, tiers.disk_used))


_NOTHING: Any = object()


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def prefill_counts(out: RequestOutput) -> tuple[int, int, int]:
    """(prefilled, resumed, prefix-cached) prompt tokens of a finished request."""
    return out.num_prefilled_tokens, out.num_resumed_tokens, out.num_cached_tokens
