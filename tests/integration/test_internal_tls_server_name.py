"""internal_tls.server_name: a certificate that names no address (as in Kubernetes, where the router dials
workers at pod IPs) is accepted when clients check it for the shared name, and refused without it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import grpc_tls
from services.common.config import TlsConfig
from tests.tls_certs import make_certs

SHARED_NAME = "kvrelay-internal"


async def _check(address: str, tls: TlsConfig) -> int:
    async with grpc_tls.channel(address, tls) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


async def test_a_shared_server_name_stands_in_for_the_address(tmp_path: Path) -> None:
    certs = make_certs(tmp_path, san=f"DNS:{SHARED_NAME}")  # no IP, no localhost: like a pod's certificate
    tls = TlsConfig(cert_file=str(certs.cert), key_file=str(certs.key), ca_file=str(certs.ca))
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = grpc_tls.add_port(server, "127.0.0.1:0", tls)
    await server.start()
    try:
        named = tls.model_copy(update={"server_name": SHARED_NAME})
        assert await _check(f"127.0.0.1:{port}", named) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(f"127.0.0.1:{port}", tls)  # checked for 127.0.0.1, which the certificate lacks
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
