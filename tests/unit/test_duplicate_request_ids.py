"""A second request under an ID already in flight is refused with ALREADY_EXISTS before it reaches the
engine or a replica, and the running request keeps its stream, its tokens and its cancellation.

Real gRPC servers in this process: the Worker and Prefill services over an engine core on the fake runner
(tests/engine_fakes.py), and the router over a fake replica (tests/router_fakes.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest

from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineStats
from services.engine.kv_export import dtype_name
from services.kvtransfer.chunks import check_header_checksum
from services.kvtransfer.ipc_transport import IpcSender
from services.kvtransfer.transport import GrpcSender
from services.prefill.prefill_service import PrefillService
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc, worker_pb2_grpc
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.replicas import ReplicaSet
from services.router.router_service import RouterService
from services.worker.counters import TransferCounters
from services.worker.server import kv_layout
from services.worker.worker_service import WorkerService
from tests.engine_fakes import make_fake_engine
from tests.router_fakes import FakeReplica, GenerateScript, serve_router, start_fake

PROMPT = [(i * 7) % 120 + 2 for i in range(24)]
LONG_PROMPT = [(i * 5) % 120 + 2 for i in range(400)]  # 13 steps of 32 tokens before its first token
NUM_TOKENS = 16  # with the fake step of 30 ms the first request runs for half a second


def generate_request(request_id: str, max_tokens: int = NUM_TOKENS) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )


def prefill_request(request_id: str, fingerprint: str, kv_dtype: str, transport: str) -> kvpb.PrefillRequest:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return kvpb.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=LONG_PROMPT,
        sampling=sampling_to_proto(params),
        model_fingerprint=fingerprint,
        kv_dtype=kv_dtype,
        transport=transport,
    )


async def wait_for_stats(engine: AsyncEngine, condition: Callable[[EngineStats], bool], what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not condition(stats := engine.stats()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within 10 s: {stats}")
        await asyncio.sleep(0.005)


@dataclass
class Node:
    """An engine on the fake runner behind the Worker service (and the Prefill service) on one server."""

    engine: AsyncEngine
    ipc: IpcSender
    channel: grpc.aio.Channel
    worker: worker_pb2_grpc.WorkerStub
    prefill: kv_transfer_pb2_grpc.PrefillStub
    fingerprint: str
    kv_dtype: str


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    core = make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8, step_seconds=0.03)
    engine = AsyncEngine(core)
    engine.start()
    in_flight: set[str] = set()
    layout = kv_layout(core)
    # expected: torch's shared-memory manager starts here, on the test's thread, as a worker whose transport
    # is ipc starts it; forked from a gRPC thread mid-call it can leave "no response from torch_shm_manager"
    ipc = IpcSender(core.device, hold_s=30.0, expected=True)
    fingerprint = core.manifest.model_fingerprint
    prefill = PrefillService(
        engine, fingerprint, layout, TransferCounters(), {"grpc": GrpcSender(), "ipc": ipc}, in_flight
    )
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(
        WorkerService(engine, pb.InfoResponse(), in_flight=in_flight), server
    )
    kv_transfer_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    worker = worker_pb2_grpc.WorkerStub(channel)
    yield Node(
        engine,
        ipc,
        channel,
        worker,
        kv_transfer_pb2_grpc.PrefillStub(channel),
        fingerprint,
        dtype_name(layout.dtype),
    )
    await channel.close()
    await server.stop(0)
    engine.shutdown()


async def tokens_of(call: AsyncIterator[pb.GenerateResponse]) -> list[int]:
    return [t async for r in call for t in r.token_ids]


async def assert_already_exists(call: AsyncIterator[object]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [_ async for _ in call]
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS, refused.value.details()


async def test_worker_refuses_a_second_generate_under_a_running_id_and_the_first_completes(
    node: Node,
) -> None:
    want = await tokens_of(node.worker.Generate(generate_request("reference"), timeout=30))
    assert len(want) == NUM_TOKENS
    first = node.worker.Generate(generate_request("same"), timeout=30)
    head = await anext(aiter(first))  # the first request runs: its first token is out
    await assert_already_exists(node.worker.Generate(generate_request("same"), timeout=5))
    rest = await tokens_of(first)
    assert [*head.token_ids, *rest] == want, "the first request lost tokens to the duplicate"
    # The ID is free again once its request ended.
    assert await tokens_of(node.worker.Generate(generate_request("same"), timeout=30)) == want


async def test_a_refused_duplicate_leaves_the_first_request_cancellable(node: Node) -> None:
    first = node.worker.Generate(generate_request("cancel-me", max_tokens=400), timeout=30)
    await anext(aiter(first))
    await assert_already_exists(node.worker.Generate(generate_request("cancel-me"), timeout=5))
    first.cancel()
    await wait_for_stats(
        node.engine,
        lambda s: s.num_running == s.num_waiting == s.kv_blocks.num_active == 0,
        "the cancelled request's release",
    )
    assert node.engine.stats().num_aborted == 1
    assert len(await tokens_of(node.worker.Generate(generate_request("cancel-me"), timeout=30))) == NUM_TOKENS


async def test_prefill_refuses_an_id_its_engine_runs_and_the_first_transfer_completes(node: Node) -> None:
    first = node.prefill.Prefill(prefill_request("p1", node.fingerprint, node.kv_dtype, "grpc"), timeout=30)
    responses = aiter(first)
    await wait_for_stats(
        node.engine, lambda s: s.num_running + s.num_waiting > 0, "the first prefill's start"
    )
    second = prefill_request("p1", node.fingerprint, node.kv_dtype, "grpc")
    await assert_already_exists(node.prefill.Prefill(second, timeout=5))
    # A Generate under the same ID on the same engine is refused as well.
    await assert_already_exists(node.worker.Generate(generate_request("p1"), timeout=5))
    header = (await anext(responses)).header
    check_header_checksum(header)
    chunks = [r.chunk async for r in responses]
    assert header.num_kv_tokens == len(LONG_PROMPT) and len(chunks) == header.num_chunks
    assert sum(c.num_tokens for c in chunks) == len(LONG_PROMPT)


async def test_prefill_takes_the_id_again_while_the_first_call_still_ships(node: Node) -> None:
    """The decode replica's ipc way out: it cancels a transfer and pulls the same ID again at once, while
    the first call may still hold its export. Only the engine's part holds the ID."""
    request = prefill_request("again", node.fingerprint, node.kv_dtype, "ipc")
    request.ipc_domain = node.ipc.domain
    first = node.prefill.Prefill(request, timeout=30)
    responses = aiter(first)
    items = [await anext(responses) for _ in range(2)]  # the header, then the one chunk; P holds on
    assert items[0].header.num_chunks == 1 and items[1].chunk.HasField("ipc")
    second = prefill_request("again", node.fingerprint, node.kv_dtype, "grpc")
    replies = [r async for r in node.prefill.Prefill(second, timeout=30)]
    assert replies[0].header.num_kv_tokens == len(LONG_PROMPT)
    first.cancel()


async def test_router_refuses_an_id_it_is_routing_and_the_first_stream_completes() -> None:
    hold = threading.Event()  # the fake replica waits on it in its server's thread
    fake = start_fake(FakeReplica("fp-dup"))
    fake.replica.script = GenerateScript(token_ids=[5, 6, 7], hold=hold)
    replicas = ReplicaSet([fake.address], TokenSource("t"), watch_kv_events=False)
    await replicas.refresh()
    router = await serve_router(RouterService(replicas))
    try:
        first = asyncio.create_task(tokens_of(router.stub.Generate(generate_request("routed"), timeout=30)))
        deadline = time.monotonic() + 10.0
        while not fake.replica.generate_calls:
            assert time.monotonic() < deadline, "the first request never reached the replica"
            await asyncio.sleep(0.01)
        await assert_already_exists(router.stub.Generate(generate_request("routed"), timeout=5))
        hold.set()
        assert await first == [5, 6, 7]
        assert len(fake.replica.generate_calls) == 1 and fake.replica.abort_calls == []
    finally:
        hold.set()
        await router.close()
        await replicas.close()
        fake.stop()
