"""The replicas behind the router: their channels, identity, health and load, refreshed in the background.

A replica whose `model_fingerprint` differs from the pool's is never used, and says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_auth import TokenSource
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0


@dataclass
class Replica:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    info: pb.InfoResponse | None = None
    load: pb.LoadResponse = field(default_factory=pb.LoadResponse)
    healthy: bool = False
    fingerprint_ok: bool = True
    in_flight: int = 0

    @property
    def usable(self) -> bool:
        return self.healthy and self.fingerprint_ok and self.info is not None


class ReplicaSet:
    def __init__(
        self, addresses: list[str], tokens: TokenSource, model_fingerprint: str | None = None
    ) -> None:
        self.tokens = tokens
        self.replicas: list[Replica] = []
        for i, address in enumerate(addresses):
            channel = grpc.aio.insecure_channel(address)
            self.replicas.append(
                Replica(
                    f"worker-{i}",
                    address,
                    channel,
                    worker_pb2_grpc.WorkerStub(channel),
                    health_pb2_grpc.HealthStub(channel),
                )
            )
        # The pool's model: given, or else the first replica to report one defines it.
        self.model_fingerprint: str | None = model_fingerprint

    def usable(self, roles: frozenset[str] | None = None) -> list[Replica]:
        """Healthy replicas of the pool's model; only those whose role is in `roles`, when given."""
        return [
            r
            for r in self.replicas
            if r.usable and (roles is None or (r.info is not None and r.info.role in roles))
        ]

    async def refresh(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe(self, replica: Replica) -> None:
        try:
            check = await replica.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S
            )
            serving = check.status == health_pb2.HealthCheckResponse.SERVING
            md = self.tokens.metadata()
            if replica.info is None and serving:
                replica.info = await replica.stub.Info(pb.InfoRequest(), metadata=md, timeout=PROBE_TIMEOUT_S)
                self._check_fingerprint(replica)
            replica.load = await replica.stub.Load(pb.LoadRequest(), metadata=md, timeout=PROBE_TIMEOUT_S)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            serving = False
            if replica.healthy:
                log.warning(
                    "replica unhealthy",
                    extra={"replica": replica.name, "address": replica.address, "error": type(exc).__name__},
                )
        if serving and not replica.healthy:
            log.info("replica healthy", extra={"replica": replica.name, "address": replica.address})
        replica.healthy = serving

    def _check_fingerprint(self, replica: Replica) -> None:
        if replica.info is None:
            return
        fingerprint = replica.info.model_fingerprint
        if self.model_fingerprint is None:
            self.model_fingerprint = fingerprint
        replica.fingerprint_ok = fingerprint == self.model_fingerprint
        if not replica.fingerprint_ok:
            log.error(
                "replica serves another model; never used",
                extra={
                    "replica": replica.name,
                    "address": replica.address,
                    "model_fingerprint": fingerprint,
                    "expected_fingerprint": self.model_fingerprint,
                },
            )

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas))
