"""Health probes: the ones the supervisor (services/common/supervisor.py) runs against the children of
`kvrelay up` and of the benchmarks' stacks, and the images' `kvrelay-healthcheck`. Each answers a plain
bool and never raises: a service that cannot be reached is simply not healthy. Both bypass any HTTP proxy
in the environment. Torch-free."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_tls
from services.common.config import TlsConfig

LIVENESS_SERVICE = "kvrelay.liveness"  # the worker's health service that fails when its engine loop stalls


class HealthCheck(Protocol):
    def is_healthy(self) -> bool:
        """True when the service says it is ready to serve. Never raises: unreachable means False."""
        ...


@dataclass(frozen=True)
class GrpcHealthCheck:
    """The standard grpc.health.v1 Check (exempt from the internal token): SERVING means healthy."""

    address: str
    timeout_s: float = 1.0
    service: str = ""
    tls: TlsConfig | None = None  # internal mutual TLS, when the stack runs with it

    def is_healthy(self) -> bool:
        options = [("grpc.enable_http_proxy", 0)]
        with _channel(self.address, self.tls, options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=self.service)
            try:
                reply = stub.Check(request, timeout=self.timeout_s)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _channel(address: str, tls: TlsConfig | None, options: list[tuple[str, int]]) -> grpc.Channel:
    if tls is None or not grpc_tls.is_enabled(tls):
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(
        address, grpc_tls.sync_credentials(tls), options=grpc_tls.client_options(tls, options)
    )


@dataclass(frozen=True)
class HttpReadyCheck:
    """An HTTP GET (no proxy): any 2xx answer means healthy."""

    url: str
    timeout_s: float = 1.0

    def is_healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url, timeout=self.timeout_s) as response:
                return 200 <= int(response.status) < 300
        except (OSError, ValueError):  # URLError, HTTPError and timeouts are all OSErrors
            return False
