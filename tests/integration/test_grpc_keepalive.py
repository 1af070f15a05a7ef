"""Keepalive on the internal gRPC hops (services/common/grpc_tls.py): a peer cut off by a network
partition (a proxy that drops every byte both ways and closes nothing) is found by the channel's pings and
its open call fails UNAVAILABLE, where without keepalive it would wait for the kernel's TCP timeout; an idle
channel pinging an internal server stays open, where a server with gRPC's default ping policy closes it
for too_many_pings; a connection reset fails the call at once. Shortened ping periods (1 s) stand in for
the production ones, the same options otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import TlsConfig
from services.common.grpc_tls import channel, keepalive_options, server_options
from tests.fault_proxy import BLACKHOLE, FaultProxy

FAST = {"time_ms": 1000, "timeout_ms": 1000}


async def start_server(options: list[tuple[str, Any]]) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest_asyncio.fixture
async def internal() -> AsyncIterator[tuple[int, FaultProxy]]:
    server, port = await start_server(server_options(**FAST))
    proxy = FaultProxy(port)
    yield port, proxy
    proxy.close()
    await server.stop(None)


async def test_a_partitioned_peer_is_found_by_keepalive(internal: tuple[int, FaultProxy]) -> None:
    _, proxy = internal
    async with channel(f"127.0.0.1:{proxy.port}", TlsConfig(), keepalive_options(**FAST)) as chan:
        watch = health_pb2_grpc.HealthStub(chan).Watch(health_pb2.HealthCheckRequest())
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        proxy.mode = BLACKHOLE  # from now on nothing crosses, and no connection is closed
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await asyncio.wait_for(watch.read(), timeout=30)  # bounded: without keepalive it never ends
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_reset_fails_the_open_call_at_once(internal: tuple[int, FaultProxy]) -> None:
    _, proxy = internal
    async with channel(f"127.0.0.1:{proxy.port}", TlsConfig()) as chan:
        watch = health_pb2_grpc.HealthStub(chan).Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        proxy.reset()
        with pytest.raises(grpc.aio.AioRpcError) as cut:  # well before keepalive could have found it (10 s)
            await asyncio.wait_for(watch.read(), timeout=5)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE


async def idle_channel_stays_ready(port: int, idle_s: float) -> bool:
    """Whether a channel pinging every second stays READY for `idle_s` with no call on it."""
    async with channel(f"127.0.0.1:{port}", TlsConfig(), keepalive_options(**FAST)) as chan:
        await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest())
        assert chan.get_state() == grpc.ChannelConnectivity.READY
        try:
            await asyncio.wait_for(chan.wait_for_state_change(grpc.ChannelConnectivity.READY), idle_s)
        except TimeoutError:
            return True
        return False


async def test_an_idle_channel_is_never_closed_for_its_pings(internal: tuple[int, FaultProxy]) -> None:
    port, _ = internal
    assert await idle_channel_stays_ready(port, idle_s=6)
    # the control: gRPC's default server policy takes 2 pings without a call, then closes (GOAWAY)
    default_server, default_port = await start_server([])
    try:
        assert not await idle_channel_stays_ready(default_port, idle_s=20)
    finally:
        await default_server.stop(None)
