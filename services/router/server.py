"""`kvrelay router`: forwards the internal API to workers found by discovery.

Discovery (services/router/discovery.py) is a static list (`workers`), or Kubernetes EndpointSlices: a
task feeds every membership change to `ReplicaSet.apply`, so replicas are added and drained without a
restart. If discovery ever stops, the router shuts down (its supervisor restarts it).
Health "" is SERVING while at least one worker is usable (healthy and serving the pool's model).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import tracing
from services.common.config import DisaggregationConfig, RouterConfig, TlsConfig, TracingConfig
from services.common.grpc_auth import InternalTokenInterceptor, TokenSource
from services.common.grpc_server import drain, stop_on_signals
from services.common.grpc_tls import add_port, server_options
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.discovery import Discovery, StaticDiscovery
from services.router.metrics import serve_metrics
from services.router.replicas import ReplicaSet
from services.router.router_service import DECODE_ROLES, RouterService, RouterStatusService

log = logging.getLogger(__name__)
REFRESH_SECONDS = 1.0


@dataclass(frozen=True)
class RouterOptions:
    host: str
    port: int
    workers: list[str]
    grace_seconds: float = 30.0
    model_fingerprint: str | None = None
    disaggregation: DisaggregationConfig | None = None
    discovery: Discovery | None = None  # None: StaticDiscovery(workers)
    routing: RouterConfig | None = None
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; off when None
    tls: TlsConfig | None = None  # internal mutual TLS, to workers and from the codec
    tracing: TracingConfig | None = None  # OTLP tracing (service `<prefix>-router`); off when None or unset


async def serve(options: RouterOptions) -> None:
    tracing.setup_tracing(options.tracing or TracingConfig(), "router")
    try:
        await _serve(options)
    finally:
        tracing.shutdown_tracing()  # export the spans still buffered


async def _serve(options: RouterOptions) -> None:
    tokens = TokenSource.from_env()
    replicas = ReplicaSet(options.workers, tokens, options.model_fingerprint, tls=options.tls)
    service = RouterService(replicas, options.disaggregation, options.routing)
    if options.metrics_port is not None:
        serve_metrics(service, options.host, options.metrics_port)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(tokens)], options=server_options())
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    worker_pb2_grpc.add_RouterServicer_to_server(RouterStatusService(replicas), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    add_port(server, address, options.tls or TlsConfig())
    await server.start()
    discovery = options.discovery or StaticDiscovery(options.workers)
    log.info(
        "router started",
        extra={"address": address, "workers": options.workers, "discovery": type(discovery).__name__},
    )
    stop = stop_on_signals()
    discoverer = _start_discovery(discovery, replicas, stop)
    refresher = asyncio.create_task(_refresh(replicas, health_servicer, stop))
    await stop.wait()
    await drain(server, health_servicer, options.grace_seconds)
    discoverer.cancel()
    refresher.cancel()
    await replicas.close()


def _start_discovery(discovery: Discovery, replicas: ReplicaSet, stop: asyncio.Event) -> asyncio.Task[None]:
    """Feed discovery's membership to `replicas`; if discovery ends on its own, stop the router."""

    def ended(task: asyncio.Task[None]) -> None:
        if task.cancelled() and stop.is_set():
            return
        log.error("discovery stopped; shutting down", exc_info=None if task.cancelled() else task.exception())
        stop.set()

    task = asyncio.create_task(discovery.run(replicas.apply))
    task.add_done_callback(ended)
    return task


async def _refresh(
    replicas: ReplicaSet, health_servicer: health.aio.HealthServicer, stop: asyncio.Event
) -> None:
    serving: bool | None = None
    while not stop.is_set():
        await replicas.refresh()
        usable = bool(replicas.usable(DECODE_ROLES))  # streams need a decode (or colocated) replica
        if usable != serving:
            serving = usable
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if usable
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health_servicer.set("", status)
        await asyncio.sleep(REFRESH_SECONDS)
