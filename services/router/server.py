"""`kvrelay router`: forwards the internal API to workers from a static list.

Health "" is SERVING while at least one worker is usable (healthy and serving the pool's model).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import DisaggregationConfig
from services.common.grpc_auth import InternalTokenInterceptor, TokenSource
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
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


async def serve(options: RouterOptions) -> None:
    tokens = TokenSource.from_env()
    replicas = ReplicaSet(options.workers, tokens, options.model_fingerprint)
    service = RouterService(replicas, options.disaggregation)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(tokens)])
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    worker_pb2_grpc.add_RouterServicer_to_server(RouterStatusService(replicas), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    server.add_insecure_port(address)
    await server.start()
    log.info("router started", extra={"address": address, "workers": options.workers})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    refresher = asyncio.create_task(_refresh(replicas, health_servicer, stop))
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(options.grace_seconds)
    refresher.cancel()
    await replicas.close()


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
