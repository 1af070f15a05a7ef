"""A worker's bounded waiting queue (engine.max_waiting_requests, services/worker/worker_service.py): at
the cap a new Generate is refused RESOURCE_EXHAUSTED with the busy mark before the engine sees it (nothing
added, nothing leaked), and served again once the queue has room; requests taken between two engine
steps count; the high class is never refused. A real gRPC server over an engine on the fake runner."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import priority
from services.common.grpc_server import is_busy
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.worker.worker_service import WorkerService
from tests.engine_fakes import make_fake_engine

CAP = 2


@pytest.fixture
def in_flight() -> set[str]:
    return set()


@pytest.fixture
async def worker(in_flight: set[str]) -> AsyncIterator[tuple[AsyncEngine, worker_pb2_grpc.WorkerStub]]:
    engine = AsyncEngine(make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8))
    engine.start()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerService(engine, pb.InfoResponse(), in_flight=in_flight, max_waiting=CAP), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield engine, worker_pb2_grpc.WorkerStub(channel)
    await server.stop(0)
    engine.shutdown()


def generate_request(request_id: str, klass: int = priority.NORMAL) -> pb.GenerateRequest:
    sampling = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7, 8], sampling=sampling, priority=klass
    )


async def test_a_full_waiting_queue_refuses_and_room_serves_again(
    worker: tuple[AsyncEngine, worker_pb2_grpc.WorkerStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, stub = worker
    real_stats = engine.stats
    monkeypatch.setattr(engine, "stats", lambda: dataclasses.replace(real_stats(), num_waiting=CAP))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [r async for r in stub.Generate(generate_request("over"), timeout=10)]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and is_busy(refused.value)
    assert "max_waiting_requests" in (refused.value.details() or "")
    assert real_stats().num_running == 0 and real_stats().num_waiting == 0  # the engine never saw it
    monkeypatch.setattr(engine, "stats", real_stats)
    served = [t async for r in stub.Generate(generate_request("room"), timeout=30) for t in r.token_ids]
    assert len(served) == 4


async def test_a_burst_taken_between_two_steps_counts_and_the_high_class_passes(
    worker: tuple[AsyncEngine, worker_pb2_grpc.WorkerStub], in_flight: set[str]
) -> None:
    _, stub = worker
    in_flight.update({"taken-1", "taken-2"})  # taken by this process, not yet in the engine's count
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [r async for r in stub.Generate(generate_request("third"), timeout=10)]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    served = [
        t
        async for r in stub.Generate(generate_request("vip", priority.HIGH), timeout=30)
        for t in r.token_ids
    ]
    assert len(served) == 4  # the high class is never refused for the queue
