"""Prometheus metrics, one registry per app."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentrt.engine_worker import EngineWorker
from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.llm_engine import StepTiming

STEP_KINDS = ("decode-graph", "decode-eager", "mixed", "prefill")
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, worker: EngineWorker, chain_counts: Callable[[], tuple[int, int]]):
        self.registry = r = CollectorRegistry()
        Gauge("agentrt_kv_pages_used", "KV pages in use", registry=r).set_function(lambda: worker.snapshot.pages_used)
        Gauge("agentrt_kv_pages_free", "KV pages free", registry=r).set_function(lambda: worker.snapshot.pages_free)
        Gauge("agentrt_requests_running", "engine requests in flight", registry=r).set_function(
            lambda: worker.snapshot.num_requests)
        chains = Gauge("agentrt_chains", "chains by state", ["state"], registry=r)
        chains.labels("busy").set_function(lambda: chain_counts()[0])
        chains.labels("idle").set_function(lambda: chain_counts()[1] - chain_counts()[0])
        tier_bytes = Gauge("agentrt_chain_tier_bytes", "bytes of idle chains' KV held per tier", ["tier"], registry=r)
        tier_bytes.labels("host").set_function(lambda: worker.snapshot.tier_bytes[0])
        tier_bytes.labels("disk").set_function(lambda: worker.snapshot.tier_bytes[1])
        moved = Gauge("agentrt_chain_tier_tokens", "tokens of chain KV moved: offloaded to host, spilled to disk, "
                      "loaded back from each tier", ["move"], registry=r)
        for move, read in (("offloaded", lambda c: c.offloaded_tokens), ("spilled", lambda c: c.spilled_tokens),
                           ("loaded_host", lambda c: c.loaded_tokens["host"]),
                           ("loaded_disk", lambda c: c.loaded_tokens["disk"])):
            moved.labels(move).set_function(lambda read=read: 0 if worker.snapshot.tiers is None
                                            else read(worker.snapshot.tiers))
        seconds = Gauge("agentrt_chain_tier_seconds", "wall seconds spent moving chain KV: device -> host copies "
                        "(offload), host -> disk writes on the writer thread (spill), loads from each tier, and turns' "
                        "waits for asynchronous loads (load_wait)", ["move"], registry=r)
        for move in ("offload", "spill", "load_host", "load_disk", "load_wait"):
            seconds.labels(move).set_function(lambda move=move: 0 if worker.snapshot.tiers is None
                                              else worker.snapshot.tiers.seconds[move])
        loads = Gauge("agentrt_chain_tier_loads", "chain loads by outcome: from host, from disk, failed (recomputed), "
                      "copies dropped, disk writes failed (recomputed), disk copies dropped because recomputing "
                      "was estimated faster than reading them (recomputed_by_cost, also counted in dropped)",
                      ["outcome"], registry=r)
        for outcome, read in (("host", lambda c: c.loads["host"]), ("disk", lambda c: c.loads["disk"]),
                              ("failed", lambda c: c.failed_loads), ("dropped", lambda c: c.dropped),
                              ("failed_writes", lambda c: c.failed_writes),
                              ("recomputed_by_cost", lambda c: c.recomputed_by_cost)):
            loads.labels(outcome).set_function(lambda read=read: 0 if worker.snapshot.tiers is None
                                               else read(worker.snapshot.tiers))
        copies = Gauge("agentrt_chain_tier_host_copies", "host copies of chains' pages made at their turns' ends "
                       "(made), and those a reclaim took instead of copying on a step's path (taken)", ["outcome"],
                       registry=r)
        for outcome, read in (("made", lambda c: c.copies_made), ("taken", lambda c: c.copies_taken)):
            copies.labels(outcome).set_function(lambda read=read: 0 if worker.snapshot.tiers is None
                                                else read(worker.snapshot.tiers))
        # the measured rates a turn weighs to read its chain from disk or recompute it (engine.tier_cost)
        Gauge("agentrt_chain_tier_disk_read_bytes_per_second", "measured read rate of chain files from the disk tier "
              "(recent loads; 0 until one is measured)", registry=r).set_function(
            lambda: 0 if worker.snapshot.tiers is None else worker.snapshot.tiers.disk_read_bytes_per_s)
        Gauge("agentrt_chain_tier_prefill_tokens_per_second", "measured prefill rate: prompt tokens per second of the "
              "recent steps that ran them (0 until measured)", registry=r).set_function(
            lambda: 0 if worker.snapshot.tiers is None else worker.snapshot.tiers.prefill_tokens_per_s)
        self.tokens_prefilled = Counter("agentrt_tokens_prefilled", "prompt tokens computed", registry=r)
        self.tokens_resumed = Counter("agentrt_tokens_resumed", "prompt tokens re-attached from a chain", registry=r)
        self.tokens_cached = Counter("agentrt_tokens_prefix_cached", "prompt tokens from the prefix cache", registry=r)
        self.tokens_generated = Counter("agentrt_tokens_generated", "tokens generated", registry=r)
        self.tokens_pruned = Counter("agentrt_tokens_pruned", "KV slots dropped by pruning (per layer and head)",
                                     registry=r)
        self.turns = Counter("agentrt_turns", "chain turns by outcome", ["outcome"], registry=r)
        self.step_seconds = Histogram("agentrt_engine_step_seconds", "wall time of one engine step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_requests = Histogram("agentrt_engine_step_requests", "requests that got a token in one step",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.steps_by_kind = Counter("agentrt_engine_steps", "engine forward steps by kind (decode-graph, "
                                     "decode-eager, mixed, prefill)", ["kind"], registry=r)
        self.step_seconds_by_kind = Counter("agentrt_engine_step_seconds_by_kind", "wall seconds of engine steps "
                                            "by kind", ["kind"], registry=r)
        for kind in STEP_KINDS:
            self.steps_by_kind.labels(kind)
            self.step_seconds_by_kind.labels(kind)

    def observe_step(self, seconds: float, outputs: list[RequestOutput], timing: StepTiming | None = None) -> None:
        """``timing``: the engine's ``StepTiming`` of that step (its kind, and how many decode steps it ran)."""
        self.step_seconds.observe(seconds)
        if outputs:
            self.step_requests.observe(len(outputs))
        if timing is not None:
            self.steps_by_kind.labels(timing.kind).inc(timing.decode_steps)
            self.step_seconds_by_kind.labels(timing.kind).inc(seconds)

    def record_request(self, prefilled: int, resumed: int, cached: int, generated: int) -> None:
        self.tokens_prefilled.inc(prefilled)
        self.tokens_resumed.inc(resumed)
        self.tokens_cached.inc(cached)
        self.tokens_generated.inc(generated)

    def record_prune(self, tokens_freed: int) -> None:
        self.tokens_pruned.inc(tokens_freed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
