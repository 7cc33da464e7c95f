"""The Ray Serve application: HTTP replicas (the Litestar app, every route as in one process) in front of engine
replicas (agentrt.scaleout.replica), chains routed to their owner (agentrt.scaleout.router).

``agentrt serve --replicas N`` runs it on a local Ray instance (``serve_local``); ``serve run`` / ``serve deploy``
with a config file whose ``import_path`` is ``agentrt.scaleout.deploy:app_builder`` runs it on a cluster
(docs/scale-out.md).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from agentrt.config import ServerConfig
from agentrt.scaleout.replica import EngineReplica
from agentrt.scaleout.router import ChainAffinityRouter

log = logging.getLogger(__name__)
APP_NAME = "agentrt"


@dataclass(slots=True)
class ScaleOut:
    replicas: int = 2  # engine replicas
    http_replicas: int = 1
    affinity: bool = True  # False: engine replicas picked at random (the chain-unaware baseline)
    engine_cpus: float = 1.0  # Ray resources per engine replica
    engine_gpus: float = 0.0
    lease_ttl_s: float = 30.0
    autoscaling: dict[str, Any] | None = None  # Ray Serve autoscaling_config of the engine deployment
    ray_actor_options: dict[str, Any] = field(default_factory=dict)  # more options of the engine replicas

    def check(self) -> None:
        if self.replicas < 1 and self.autoscaling is None:
            raise ValueError(f"replicas must be at least 1, not {self.replicas}")
        if self.http_replicas < 1:
            raise ValueError(f"http_replicas must be at least 1, not {self.http_replicas}")


@serve.ingress()
class HttpIngress:
    """One HTTP replica: the server's Litestar app with a RemoteEngine in place of the in-process engine."""

    def __init__(self, config: ServerConfig, engine: DeploymentHandle, lease_ttl_s: float = 30.0):
        self.config = config
        self.engine = engine
        self.lease_ttl_s = lease_ttl_s

    def __serve_build_asgi_app__(self) -> Any:
        from agentrt.app import create_app
        from agentrt.scaleout.leases import ChainLeases
        from agentrt.scaleout.remote_engine import RemoteEngine

        holder = serve.get_replica_context().replica_id.unique_id
        config, handle, ttl = self.config, self.engine, self.lease_ttl_s

        async def remote(db: Any) -> tuple[RemoteEngine, ChainLeases]:
            leases = ChainLeases(db, holder, ttl)
            worker = RemoteEngine(handle, db, leases, config.max_queue_depth, config.retry_after_s)
            await worker.start()
            return worker, leases

        return create_app(config, remote=remote)


def build_application(config: ServerConfig, scale: ScaleOut) -> Application:
    scale.check()
    engine_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": scale.engine_cpus, "num_gpus": scale.engine_gpus,
                              **scale.ray_actor_options},
        # a chain's turns must reach its owner however busy it is: the engine's own queue bound answers 503
        "max_ongoing_requests": max(64, 2 * (config.max_queue_depth or 1024)),
        "request_router_config": RequestRouterConfig(
            request_router_class=ChainAffinityRouter, request_router_kwargs={"affinity": scale.affinity},
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0),
        "graceful_shutdown_timeout_s": 30.0,
    }
    if scale.autoscaling is not None:
        engine_options["autoscaling_config"] = scale.autoscaling
    else:
        engine_options["num_replicas"] = scale.replicas
    engine = serve.deployment(EngineReplica, name="engine", **engine_options)
    http = serve.deployment(HttpIngress, name="http", num_replicas=scale.http_replicas,
                            max_ongoing_requests=4 * (config.max_queue_depth or 1024),
                            ray_actor_options={"num_cpus": HTTP_CPUS})
    return http.bind(config, engine.bind(config), scale.lease_ttl_s)


def app_builder(args: dict[str, Any]) -> Application:
    """For ``serve run`` / ``serve deploy`` (Ray Serve's application builder): ``args`` holds ServerConfig fields
    under ``server`` and ScaleOut fields under ``scale``."""
    server = dict(args.get("server") or {})
    unknown = set(server) - {f.name for f in fields(ServerConfig)}
    if unknown:
        raise ValueError(f"unknown server option(s): {sorted(unknown)}")
    return build_application(ServerConfig(**server), ScaleOut(**dict(args.get("scale") or {})))


HTTP_CPUS = 0.5  # Ray CPUs per HTTP replica


def local_cpus(scale: ScaleOut) -> float:
    """The Ray CPUs the application asks for (a local instance is started with at least as many, so that no
    replica waits for room on a machine with fewer cores: the replicas then share them)."""
    return scale.replicas * scale.engine_cpus + scale.http_replicas * HTTP_CPUS


def serve_local(config: ServerConfig, scale: ScaleOut, port: int, ray_address: str | None = None,
                num_cpus: int | None = None) -> None:
    """Start (or join) a Ray instance, run the application with Ray Serve's HTTP proxy on ``config.host:port``
    and block until interrupted."""
    import ray

    if config.db_url is not None and ":memory:" in config.db_url:
        raise ValueError("the replicas share the database: give --db a file or a server URL, not :memory:")
    if ray_address is None and num_cpus is None:  # a local instance: room for every replica, even on few cores
        num_cpus = max(os.cpu_count() or 1, math.ceil(local_cpus(scale)))
    ray.init(address=ray_address, num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": config.host, "port": port})
    try:  # an interrupt while Ray Serve still waits for every replica (the proxy already serves) stops cleanly too
        serve.run(build_application(config, scale), name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d with %d engine replica(s), %d HTTP replica(s)", config.host, port,
                 scale.replicas, scale.http_replicas)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
