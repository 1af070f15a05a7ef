"""The router's gRPC face: the Worker API, forwarded to a chosen replica, plus Replicas for status.

A request is retried on another replica only when the chosen one is unavailable before any token went
out. A client that goes away cancels the forwarded call, which aborts the request on the worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from services.common.grpc_auth import request_id_of
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.policy import Candidate, LeastLoaded
from services.router.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class RouterService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.policy = LeastLoaded()
        self.requests_total = 0

    def choose(self, exclude: set[str]) -> Replica | None:
        usable = {r.name: r for r in self.replicas.usable() if r.name not in exclude}
        pick = self.policy.choose([Candidate(r.name, r.in_flight, r.load.waiting) for r in usable.values()])
        return usable[pick.name] if pick else None

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests_total += 1
        request_id = request.request_id or request_id_of(context)
        tried: set[str] = set()
        failure: tuple[grpc.StatusCode, str] | None = None
        while failure is None:
            replica = self.choose(tried)
            if replica is None:
                failure = (grpc.StatusCode.UNAVAILABLE, "no ready worker")
                break
            tried.add(replica.name)
            sent_any = False
            call = replica.stub.Generate(
                request, metadata=self.replicas.tokens.metadata(request_id), timeout=context.time_remaining()
            )
            replica.in_flight += 1
            try:
                async for response in call:
                    sent_any = True
                    yield response
                log.info(
                    "routed",
                    extra={"request_id": request_id, "replica": replica.name, "reason": "least_loaded"},
                )
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and not sent_any:
                    replica.healthy = False
                    log.warning(
                        "retrying on another replica",
                        extra={"request_id": request_id, "replica": replica.name},
                    )
                    continue
                failure = (exc.code(), exc.details() or exc.code().name)
            finally:
                replica.in_flight -= 1
                call.cancel()
        await context.abort(*failure)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        md = self.replicas.tokens.metadata(request.request_id)
        for replica in self.replicas.usable():
            try:
                await replica.stub.Abort(request, metadata=md, timeout=2.0)
            except grpc.aio.AioRpcError:
                log.warning("abort not delivered", extra={"replica": replica.name})
        return pb.AbortResponse()

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        for replica in self.replicas.usable():
            if replica.info is not None:
                info = pb.InfoResponse()
                info.CopyFrom(replica.info)
                info.role = "router"
                return info
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no ready worker")
        raise AssertionError("unreachable")  # context.abort raises

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        usable = self.replicas.usable()
        return pb.LoadResponse(
            running=sum(r.load.running for r in usable),
            waiting=sum(r.load.waiting for r in usable),
            requests_total=self.requests_total,
            ready=bool(usable),
        )


class RouterStatusService(worker_pb2_grpc.RouterServicer):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def Replicas(
        self, request: pb.ReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReplicasResponse:
        return pb.ReplicasResponse(
            replicas=[
                pb.Replica(
                    name=r.name,
                    role=r.info.role if r.info else "unknown",
                    address=r.address,
                    ready=r.usable,
                    load=r.load,
                )
                for r in self.replicas.replicas
            ]
        )
