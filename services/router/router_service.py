"""The router's gRPC face: the Worker API, forwarded to a chosen replica, plus Replicas for status.

A request is retried on another replica only when the chosen one is unavailable before any token went
out. A client that goes away cancels the forwarded call, which aborts the request on the worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from services.common.config import DisaggregationConfig
from services.common.grpc_auth import request_id_of
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.policy import Candidate, LeastLoaded
from services.router.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
DECODE_ROLES = frozenset({"colocated", "decode"})
PREFILL_ROLES = frozenset({"prefill"})


class RouterService(worker_pb2_grpc.WorkerServicer):
    """Streams come from a decode (or colocated) replica. When prefill replicas are ready, the router
    also picks one per request and names it in `remote_prefill`; the decode replica pulls the KV from it
    (and recomputes locally if that fails). Requests with n > 1, or prompts shorter than
    `disaggregation.min_prompt_tokens`, are prefilled on the decode replica."""

    def __init__(self, replicas: ReplicaSet, disaggregation: DisaggregationConfig | None = None) -> None:
        self.replicas = replicas
        self.disaggregation = disaggregation or DisaggregationConfig()
        self.policy = LeastLoaded()
        self.prefill_policy = LeastLoaded()
        self.requests_total = 0

    def choose(self, exclude: set[str], roles: frozenset[str] = DECODE_ROLES) -> Replica | None:
        usable = {
            r.name: r
            for r in self.replicas.usable()
            if r.name not in exclude and r.info is not None and r.info.role in roles
        }
        policy = self.prefill_policy if roles == PREFILL_ROLES else self.policy
        pick = policy.choose([Candidate(r.name, r.in_flight, r.load.waiting) for r in usable.values()])
        return usable[pick.name] if pick else None

    def _with_prefill(self, request: pb.GenerateRequest) -> tuple[pb.GenerateRequest, Replica | None]:
        too_short = len(request.prompt_token_ids) < self.disaggregation.min_prompt_tokens
        if (request.sampling.n or 1) > 1 or too_short:
            return request, None
        prefill = self.choose(set(), PREFILL_ROLES)
        if prefill is None:
            return request, None
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.remote_prefill.address = prefill.address
        forwarded.remote_prefill.transport = self.disaggregation.transport
        return forwarded, prefill

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
            forwarded, prefill = self._with_prefill(request)
            call = replica.stub.Generate(
                forwarded,
                metadata=self.replicas.tokens.metadata(request_id),
                timeout=context.time_remaining(),
            )
            replica.in_flight += 1
            if prefill is not None:
                prefill.in_flight += 1
            try:
                async for response in call:
                    sent_any = True
                    yield response
                log.info(
                    "routed",
                    extra={
                        "request_id": request_id,
                        "replica": replica.name,
                        "prefill": prefill.name if prefill else None,
                        "reason": "least_loaded",
                    },
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
                if prefill is not None:
                    prefill.in_flight -= 1
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
            ready=bool(self.replicas.usable(DECODE_ROLES)),
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
