"""Rank processes of a tensor-parallel engine (SPMD replicas) and how rank 0 drives them.

Rank 0 is the caller's ``LLMEngine``; it spawns ranks 1..N-1 (``torch.multiprocessing``, spawn), each of
which builds the same engine for its rank and then waits on a pipe. Every public call that changes engine
state is ``mirrored``: rank 0 sends it to every rank, runs it itself, then collects each rank's outcome, so
every rank's scheduler sees the same calls in the same order and makes the same decisions (each rank holds the
same number of KV heads, so page counts agree too). Only rank 0's return value is used.

Failures: a rank that raises an ``EngineError`` (bad input: rank 0 raises the same) stays up; any other
exception is sent to rank 0 and the rank exits, which breaks the collectives rank 0 may be waiting in; rank 0
then re-raises it as ``TensorParallelError`` naming the rank, and the engine refuses further calls. A rank
that dies is noticed while rank 0 waits for it (its process is polled), never waited on forever.
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Callable

import torch

from engine.errors import EngineError
from engine.parallel.state import SINGLE, TPGroup, destroy_group, free_port, init_group, rank_device, use_group

JOIN_TIMEOUT_S = 60.0  # a loaded machine can take a while to tear a rank down
COLLECTIVE_TIMEOUT_S = 300.0  # a collective a peer never joins fails after this (a live but stuck rank)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died or diverged; the message names the rank."""


def mirrored(fn: Callable) -> Callable:
    """An ``LLMEngine`` method every rank runs, in the same order, inside the engine's group."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any):
        with use_group(self.tp):
            return self._tp_link.call(name, args, kwargs, lambda: fn(self, *args, **kwargs))

    return wrapper


class Local:
    """The link of an engine with no other ranks (and of ranks > 0, which only run what they are sent)."""

    def call(self, name: str, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        return run()

    def agree_min(self, value: int) -> int:
        return value

    def wait_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


LOCAL = Local()


class RankLink(Local):
    """Rank r > 0's side of the pipe to rank 0, for the agreements made while the engine is built."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def agree_min(self, value: int) -> int:
        self.conn.send(("value", value))
        return self.conn.recv()


class Workers(Local):
    """Rank 0's handle on ranks 1..N-1: spawned here, joined (or killed) by ``close``."""

    def __init__(self, config, world_size: int, port: int, timeout_s: float) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        self.broken: str | None = None
        self.closed = False
        for rank in range(1, world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"agentrt-tp-rank{rank}", daemon=True,
                               args=(rank, world_size, port, config, child, torch.get_num_threads(), timeout_s))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    # --- receiving --------------------------------------------------------------------------------
    def _recv(self, rank: int, what: str):
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        while not conn.poll(0.05):
            if not proc.is_alive():
                if conn.poll(0):
                    break
                self._fail(f"tensor-parallel rank {rank} died (exit code {proc.exitcode}) during {what}")
        try:
            return conn.recv()
        except (EOFError, OSError):
            proc.join(1.0)
            self._fail(f"tensor-parallel rank {rank} died (exit code {proc.exitcode}) during {what}")

    def _expect(self, rank: int, kind: str, what: str):
        reply = self._recv(rank, what)
        if reply[0] == "error":
            self._fail(f"tensor-parallel rank {rank} failed during {what}:\n{reply[1]}")
        if reply[0] != kind:
            self._fail(f"tensor-parallel rank {rank} answered {reply[0]!r} during {what}, expected {kind!r}")
        return reply

    def _fail(self, message: str):
        self.broken = message
        self.close()
        raise TensorParallelError(message)

    # --- building -----------------------------------------------------------------------------------
    def wait_started(self) -> None:
        for rank in range(1, len(self.procs) + 1):
            self._expect(rank, "started", "start-up")

    def agree_min(self, value: int) -> int:
        values = [self._expect(rank, "value", "engine build")[1] for rank in range(1, len(self.procs) + 1)]
        agreed = min([value, *values])
        for conn in self.conns:
            conn.send(agreed)
        return agreed

    def wait_ready(self) -> None:
        for rank in range(1, len(self.procs) + 1):
            self._expect(rank, "ready", "engine build")

    # --- mirrored calls -----------------------------------------------------------------------------
    def call(self, name: str, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel engine is unusable: {self.broken}")
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(("call", name, args, kwargs))
            except (BrokenPipeError, EOFError, OSError):
                self._fail(f"tensor-parallel rank {rank} died (exit code {self.procs[rank - 1].exitcode}) "
                           f"before {name}")
        try:
            result = run()
        except EngineError as exc:
            self._collect(name, exc)
            raise
        except BaseException as exc:
            self._diagnose(name, exc)
            raise
        self._collect(name, None)
        return result

    def _collect(self, name: str, local: EngineError | None) -> None:
        for rank in range(1, len(self.procs) + 1):
            reply = self._recv(rank, name)
            if reply[0] == "error":
                self._fail(f"tensor-parallel rank {rank} failed in {name}:\n{reply[1]}")
            raised = reply[1] if reply[0] == "engine_error" else None
            if (raised is None) != (local is None):
                self._fail(f"tensor-parallel rank {rank} diverged from rank 0 in {name}: rank 0 "
                           f"{'raised ' + repr(local) if local else 'returned'}, rank {rank} "
                           f"{'raised ' + raised if raised else 'returned'}")

    def _diagnose(self, name: str, exc: BaseException) -> None:
        """Rank 0 failed outside the contract (often: a collective broke because a peer went away). Name the
        peer that failed or died if there is one, and stop every rank: they may be waiting in a collective."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            proc.join(0.5)
            if conn.poll(0):
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    reply = ("died",)
                if reply[0] == "error":
                    self.broken = f"tensor-parallel rank {rank} failed in {name}:\n{reply[1]}"
                    self.close()
                    raise TensorParallelError(self.broken) from exc
            if not proc.is_alive():
                self.broken = f"tensor-parallel rank {rank} died (exit code {proc.exitcode}) during {name}"
                self.close()
                raise TensorParallelError(self.broken) from exc
        self.broken = f"rank 0 failed in {name}: {exc!r}"
        self.close()

    # --- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("close",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        destroy_group(_rank0_group[0])
        _rank0_group[0] = SINGLE


_rank0_group = [SINGLE]  # the group rank 0 of this process joined (one tensor-parallel engine at a time)


def start(config, device: torch.device, worker: tuple[TPGroup, Local] | None) -> tuple[TPGroup, Local, torch.device]:
    """(this rank's group, its link to the other ranks, its device) for an engine being built.

    ``worker`` is None in the caller's process (rank 0: spawns the other ranks and joins the group with them)
    and (group, link) in ranks > 0."""
    world = config.tensor_parallel_size
    if worker is not None:
        group, link = worker
        return group, link, rank_device(device, group.rank)
    if world == 1:
        return SINGLE, LOCAL, device
    import torch.distributed as dist

    from engine.errors import ConfigError
    from engine.model_config import ModelConfig
    from engine.parallel.layers import check_model_shards

    check_model_shards(ModelConfig.from_dir(config.model), world)  # before any process starts
    if dist.is_initialized():
        raise ConfigError("tensor_parallel_size > 1 needs this process's torch.distributed default group, which "
                          "is already initialised (another tensor-parallel engine still open? close() it)")
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise ConfigError(f"tensor_parallel_size {world} needs {world} GPUs from {device}; "
                          f"{torch.cuda.device_count()} are visible")
    port = free_port()
    workers = Workers(config, world, port, COLLECTIVE_TIMEOUT_S)
    try:
        workers.wait_started()
        _rank0_group[0] = init_group(0, world, port, device, COLLECTIVE_TIMEOUT_S)
    except BaseException:
        workers.close()
        raise
    return _rank0_group[0], workers, device


def worker_main(rank: int, world_size: int, port: int, config, conn, num_threads: int, timeout_s: float) -> None:
    torch.set_num_threads(num_threads)
    try:
        from engine.llm_engine import LLMEngine

        conn.send(("started",))
        device = rank_device(config.resolved_device(), rank)
        group = init_group(rank, world_size, port, device, timeout_s)
        engine = LLMEngine(config, _tp=(group, RankLink(conn)))
        conn.send(("ready",))
    except BaseException:
        _exit_with(conn, traceback.format_exc())
    _serve(engine, conn)
    destroy_group(group)
    conn.close()
    # Leave without interpreter teardown: destructors of the collective library's threads racing the exit
    # can abort the process ("terminate called without an active exception") under load.
    os._exit(0)


def _serve(engine, conn) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if message[0] == "close":
            return
        _, name, args, kwargs = message
        try:
            getattr(engine, name)(*args, **kwargs)
        except EngineError as exc:
            conn.send(("engine_error", repr(exc)))
        except BaseException:
            _exit_with(conn, traceback.format_exc())
        else:
            conn.send(("ok",))


def _exit_with(conn, error: str) -> None:
    """Report ``error`` to rank 0 and exit now: peers blocked in a collective with this rank see it fail, and
    no collective teardown can hang on them."""
    try:
        conn.send(("error", error))
    finally:
        os._exit(1)
