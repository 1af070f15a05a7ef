"""The public gRPC server around the API: health follows readiness, reflection, graceful stop alongside
uvicorn, and the `--grpc-port` flag."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import uvicorn
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.cli import codec as codec_cli
from services.codec.app import create_app
from services.codec.grpc_public import server as grpc_public_server
from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.server import CodecServer
from services.codec.state import CodecIdentity, CodecState
from services.codec.text.tokenizer import Tokenizer
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import FakeBackend, free_port, identity_for, make_config, scripted

pytestmark = pytest.mark.model

CHAT = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Count.")])
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


@pytest.fixture
def fake(identity: CodecIdentity) -> FakeBackend:
    return FakeBackend(identity.tokenizer_fingerprint)


@pytest.fixture
async def server(
    tokenizer: Tokenizer, identity: CodecIdentity, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[PublicGrpcServer]:
    monkeypatch.setattr(grpc_public_server, "READINESS_POLL_S", 0.02)
    state = CodecState.build(fake, tokenizer, make_config(), identity)
    async with PublicGrpcServer("127.0.0.1", 0, grace_s=5.0).serving(state) as running:
        yield running


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return int(reply.status)


async def wait_health(address: str, wanted: int, service: str = "") -> None:
    async with asyncio.timeout(5.0):
        while await health_status(address, service) != wanted:
            await asyncio.sleep(0.01)


async def test_health_follows_readiness(server: PublicGrpcServer, fake: FakeBackend) -> None:
    await wait_health(server.address, SERVING)
    await wait_health(server.address, SERVING, "kvrelay.v1.Inference")
    fake.is_unavailable = True
    await wait_health(server.address, NOT_SERVING)
    fake.is_unavailable = False
    fake.tokenizer_fingerprint = "someone-else"
    await wait_health(server.address, NOT_SERVING, "kvrelay.v1.Inference")
    assert await health_status(server.address) == NOT_SERVING


def reflected_services(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        names = list(database.get_services())
        pool = DescriptorPool(database)
        methods = [m.name for m in pool.FindServiceByName("kvrelay.v1.Inference").methods]
        return [*names, *methods]


async def test_reflection_names_the_services(server: PublicGrpcServer) -> None:
    found = await asyncio.to_thread(reflected_services, server.address)
    expected = {"kvrelay.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert expected <= set(found)
    assert {"Chat", "Generate"} <= set(found)


async def test_stop_lets_running_streams_finish_and_refuses_new_ones(
    server: PublicGrpcServer, fake: FakeBackend
) -> None:
    fake.script = scripted([[28] * 30])
    fake.delay_s = 0.01
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = public_pb2_grpc.InferenceStub(channel)
        running = stub.Chat(CHAT)
        assert (await running.read()).text
        server.begin_stop()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [_ async for _ in stub.Chat(CHAT)]
        # A call that reaches a stopping server is refused: UNAVAILABLE, or CANCELLED when the
        # server's shutdown overtakes the call on a loaded machine.
        assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        rest = []
        while (message := await running.read()) is not grpc.aio.EOF:
            rest.append(message)
    assert rest[-1].finish.reason == pb.SampleFinish.STOP and rest[-1].usage.completion_tokens == 31
    assert len(fake.completed) == 1 and fake.closed_early == []
    await server.stop()


def test_http_and_grpc_drain_together_before_the_backend_closes(
    tokenizer: Tokenizer, identity: CodecIdentity, fake: FakeBackend
) -> None:
    fake.script = scripted([[28] * 40])
    fake.delay_s = 0.01
    public = PublicGrpcServer("127.0.0.1", 0, grace_s=10.0)
    app = create_app(fake, tokenizer, make_config(), identity, serve_alongside=public.serving)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None, lifespan="on")
    codec = CodecServer(config, public)
    thread = threading.Thread(target=codec.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not codec.started:
        assert time.monotonic() < deadline and thread.is_alive(), "codec did not start"
        time.sleep(0.01)
    num_running_at_close: list[int] = []
    close = fake.close

    async def recording_close() -> None:
        num_running_at_close.append(app.state.codec.generator.num_running)
        await close()

    fake.close = recording_close  # type: ignore[method-assign]
    with grpc.insecure_channel(public.address) as channel:
        stream = public_pb2_grpc.InferenceStub(channel).Chat(CHAT)
        first = next(stream)
        codec.should_exit = True
        messages = [first, *stream]
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert messages[-1].usage.completion_tokens == 41
    assert num_running_at_close == [0] and fake.is_closed


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvrelay")
    codec_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_grpc_port_flag_is_off_unless_given() -> None:
    assert parse(["codec", "--router", "r:1"]).grpc_port is None
    assert parse(["codec", "--router", "r:1", "--grpc-port", "9001"]).grpc_port == 9001
