"""Chain-affinity routing: Ray Serve's custom request router for the engine deployment.

Each HTTP replica's deployment handle runs one of these. A request names where it wants to go in its keyword
arguments (agentrt.scaleout.remote_engine sets them):

- ``replica``: the engine replica that owns the chain (from the database's chain leases). If it is among the
  running replicas the request goes there and nowhere else, however loaded: anywhere else the chain's history is
  recomputed. If it is gone (killed, drained) the request is routed as a new chain's.
- ``prefix``: a digest of a stateless request's first tokens. Replicas are ranked for it by rendezvous hashing
  (the same on every HTTP replica, no shared state), so requests sharing a prefix meet the prefix cache that holds
  it, unless that replica is ``imbalance`` requests busier than the least loaded one.
- neither: the least loaded replica (requests in flight, then free KV pages).

``affinity=False`` ignores both and picks a replica at random: the baseline a chain-unaware router gives.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


class ChainAffinityRouter(RequestRouter):
    def initialize_state(self, affinity: bool = True, imbalance: int = 8, **_: Any) -> None:
        self.affinity = affinity
        self.imbalance = imbalance
        self._sent: Counter[ReplicaID] = Counter()  # requests this router sent and not yet seen completed

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._sent[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._sent[replica_id] > 0:
            self._sent[replica_id] -= 1

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if not self.affinity:
            return [[random.choice(candidate_replicas)]]
        kwargs = pending_request.kwargs if pending_request is not None else {}
        owner = kwargs.get("replica")
        if owner is not None:
            for r in candidate_replicas:
                if r.replica_id.unique_id == owner:
                    return [[r]]
        ranked = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=self._load)  # ties: any
        prefix = kwargs.get("prefix")
        if prefix is not None:
            preferred = max(candidate_replicas, key=lambda r: _rendezvous(prefix, r.replica_id.unique_id))
            if self._load(preferred)[0] <= self._load(ranked[0])[0] + self.imbalance:
                return [[preferred]]
        return [[r] for r in ranked]

    def _load(self, replica: RunningReplica) -> tuple[int, int]:
        """(requests in flight, -free pages): in flight is the larger of what this router has sent there (it moves
        with every request) and what the replica last reported (requests of the other HTTP replicas too)."""
        stats = replica.routing_stats or {}
        requests = max(self._sent[replica.replica_id], int(stats.get("requests", 0)))
        return requests, -int(stats.get("pages_free", 0))


def _rendezvous(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest(), "big")


def prefix_key(prompt: list[int], tokens: int = 64) -> str:
    """The digest a stateless request is routed by: its first ``tokens`` token ids (a system prompt and tools)."""
    head = prompt[:tokens]
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in head), digest_size=12).hexdigest()
