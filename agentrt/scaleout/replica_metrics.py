"""Per-engine-replica series in ``/metrics`` (label ``replica``), from the heartbeats the HTTP replica reads
(agentrt.scaleout.registry): any HTTP replica answers for all engine replicas. The unlabelled page and request
gauges are the sums over them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from agentrt.scaleout.remote_engine import RemoteEngine

SERIES = (("agentrt_replica_kv_pages_free", "KV pages free on an engine replica", "pages_free"),
          ("agentrt_replica_kv_pages", "KV pages of an engine replica", "num_pages"),
          ("agentrt_replica_requests_running", "engine requests in flight on an engine replica", "requests"),
          ("agentrt_replica_chain_tier_host_bytes", "idle chains' KV in an engine replica's host tier",
           "tier_host_bytes"),
          ("agentrt_replica_chain_tier_disk_bytes", "idle chains' KV in an engine replica's disk tier",
           "tier_disk_bytes"))


class ReplicaCollector(Collector):
    def __init__(self, worker: RemoteEngine):
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = dict(self.worker.replicas)
        up = GaugeMetricFamily("agentrt_replicas", "engine replicas heard from in the last seconds")
        up.add_metric([], len(replicas))
        yield up
        for name, doc, key in SERIES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, stats in sorted(replicas.items()):
                family.add_metric([replica], float(stats.get(key, 0)))
            yield family


def register_replica_gauges(registry: CollectorRegistry, worker: RemoteEngine) -> None:
    registry.register(ReplicaCollector(worker))
