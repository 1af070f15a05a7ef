"""A replica at the router's gRPC seam, for router tests: a real gRPC server (health + Worker API) that
answers Info and Load like a worker of a given model, streams the KV event batches a test scripts, and
answers Generate the way the test says (stream tokens, fail before the first token, fail after it)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import free_port

BREAK = object()  # put on the KV event queue: the current stream fails with UNAVAILABLE


@dataclass
class GenerateScript:
    """What Generate does: wait for `hold` (when given) before the first token; stream `token_ids`, one
    per message; fail with `fail_with` (UNAVAILABLE unless set) after `fail_after` of them (0: before any
    token; None: never).
    The last message says how the prompt was prefilled: `remote_last`'s fields when the router asked for
    a remote prefill, else PREFILL_MODE_LOCAL."""

    token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    fail_after: int | None = None
    fail_with: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    fail_metadata: tuple[tuple[str, str], ...] = ()  # trailing metadata on the failure (a worker's busy mark)
    hold: threading.Event | None = None
    remote_last: pb.GenerateResponse = field(
        default_factory=lambda: pb.GenerateResponse(prefill_mode=pb.PREFILL_MODE_REMOTE)
    )


class FakeReplica(worker_pb2_grpc.WorkerServicer):
    def __init__(self, fingerprint: str, role: str = "colocated", block_size: int = 16) -> None:
        self.info = pb.InfoResponse(
            model_fingerprint=fingerprint, role=role, block_size=block_size, kv_bytes_per_token=1
        )
        self.load = pb.LoadResponse(ready=True)
        self.script = GenerateScript()
        self.generate_calls: list[pb.GenerateRequest] = []
        self.abort_calls: list[str] = []
        self.events: queue.Queue[object] = queue.Queue()
        self.num_event_streams = 0
        self._lock = threading.Lock()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return self.info

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        return self.load

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        with self._lock:
            self.abort_calls.append(request.request_id)
        return pb.AbortResponse()

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        with self._lock:
            self.generate_calls.append(request)
        script = self.script
        if script.hold is not None:
            script.hold.wait(30)
        for i, token_id in enumerate(script.token_ids):
            if script.fail_after == i:
                if script.fail_metadata:
                    context.set_trailing_metadata(script.fail_metadata)
                context.abort(script.fail_with, "fake replica failed")
            response = pb.GenerateResponse(token_ids=[token_id])
            if i == len(script.token_ids) - 1:
                response.finish_reason = pb.FINISH_REASON_LENGTH
                response.prefill_mode = pb.PREFILL_MODE_LOCAL
                if request.remote_prefill.address:
                    response.MergeFrom(script.remote_last)
            yield response

    def KVEvents(
        self, request: pb.KVEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KVEventBatch]:
        with self._lock:
            self.num_event_streams += 1
        while context.is_active():
            try:
                item = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is BREAK:
                context.abort(grpc.StatusCode.UNAVAILABLE, "kv events stream broken")
            assert isinstance(item, pb.KVEventBatch)
            yield item


@dataclass
class FakeServer:
    replica: FakeReplica
    server: grpc.Server
    address: str

    def stop(self) -> None:
        self.server.stop(0)


def serve_worker(servicer: worker_pb2_grpc.WorkerServicer) -> tuple[grpc.Server, str]:
    """Any Worker servicer on a real gRPC server on a free loopback port, with health "" SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    return server, address


def start_fake(replica: FakeReplica) -> FakeServer:
    """`replica` served on a free loopback port, with health "" SERVING."""
    server, address = serve_worker(replica)
    return FakeServer(replica, server, address)


@dataclass
class InProcessRouter:
    """A RouterService on a real in-process gRPC server, and a stub to call it."""

    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub

    async def generate(self, request: pb.GenerateRequest) -> list[int]:
        """The request's token IDs, streamed through the router."""
        return [t for r in [r async for r in self.stub.Generate(request, timeout=30)] for t in r.token_ids]

    async def close(self) -> None:
        await self.channel.close()
        await self.server.stop(0)


async def serve_router(service: worker_pb2_grpc.WorkerServicer) -> InProcessRouter:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return InProcessRouter(server, channel, worker_pb2_grpc.WorkerStub(channel))
