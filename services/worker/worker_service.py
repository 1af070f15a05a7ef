"""The internal Worker API over the engine: Generate streams token IDs, Abort, Info and Load.

This is the colocated worker (prefill and decode in one engine); the disaggregated roles extend it.
Generate range-checks the request's values (services/common/proto_convert.py) and refuses a request ID
already in flight in this process with ALREADY_EXISTS, before the engine sees either.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from services.common import priority, tracing
from services.common.engine_input import check_unique
from services.common.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    WorkerBusyError,
)
from services.common.grpc_auth import request_id_of
from services.common.grpc_server import abort_for
from services.common.proto_convert import EngineInput, engine_input_from_proto
from services.decode.remote_prefill import RemotePrefill
from services.engine.async_engine import AsyncEngine
from services.kvcache.tier_set import TierEvent, TierReport
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.worker.counters import TransferCounters
from services.worker.outputs import output_to_proto
from services.worker.request_trace import RequestTrace

log = logging.getLogger(__name__)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        info: pb.InfoResponse,
        counters: TransferCounters | None = None,
        remote: RemotePrefill | None = None,
        in_flight: set[str] | None = None,
        max_waiting: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting  # engine.max_waiting_requests: past it, RESOURCE_EXHAUSTED
        self.info = info
        self.counters = counters or TransferCounters()
        self.remote = remote  # None: this replica never pulls KV (a prefill replica)
        self.vocab_size = engine.vocab_size
        # The request IDs this process runs now, shared with its Prefill service: the engine keeps one
        # output stream per ID, so a second request under a live ID would take the first one's stream.
        self.in_flight: set[str] = in_flight if in_flight is not None else set()
        self.requests_total = 0
        self.ready = False

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Checks the request's values (INVALID_ARGUMENT) and refuses an ID already in flight in this
        process (ALREADY_EXISTS) before the engine sees either: the running request keeps its stream. A
        full waiting queue (engine.max_waiting_requests) refuses it RESOURCE_EXHAUSTED, which the router
        takes to another replica."""
        self.requests_total += 1
        try:
            engine_input = engine_input_from_proto(request, self.vocab_size, request_id_of(context))
            check_unique(engine_input.request_id, self.in_flight)
            self._check_room(engine_input.priority)
        except (InvalidRequestError, DuplicateRequestError, WorkerBusyError) as exc:
            await abort_for(context, exc)
        request_id = engine_input.request_id
        self.in_flight.add(request_id)
        try:
            responses = self._generate(request, engine_input, context)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response
        finally:
            self.in_flight.discard(request_id)

    def _check_room(self, klass: int) -> None:
        """Refuse (WorkerBusyError) past engine.max_waiting_requests: the engine's waiting requests, or
        those this process took that have not started yet (the engine's count is a snapshot of its last
        step, and a burst lands between two), whichever is more. The high class is never refused."""
        if self.max_waiting is None or klass < priority.NORMAL:
            return
        stats = self.engine.stats()
        waiting = max(stats.num_waiting, len(self.in_flight) - stats.num_running)
        if waiting >= self.max_waiting:
            raise WorkerBusyError(
                f"{waiting} requests wait on this worker already (engine.max_waiting_requests "
                f"{self.max_waiting}); another replica should take it"
            )

    async def _generate(
        self, request: pb.GenerateRequest, engine_input: EngineInput, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        request_id = engine_input.request_id
        started = time.monotonic()
        num_tokens = 0
        trace = RequestTrace(
            tracing.extract(context.invocation_metadata()), request_id, len(engine_input.prompt_token_ids)
        )
        error: BaseException | None = None
        try:
            if self._is_remote(request):
                async for response in self._remote(request, engine_input, context, trace):
                    num_tokens += len(response.token_ids)
                    yield response
                if num_tokens:
                    return
            stream = self.engine.generate_checked(engine_input)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    if output.encode_times_ns is not None:
                        trace.encoded(*output.encode_times_ns, len(engine_input.encoder_token_ids))
                    if not num_tokens:
                        trace.decoding()  # the first output: the prompt is done
                    num_tokens += len(output.new_token_ids)
                    response = output_to_proto(output)
                    if output.finished:
                        response.prefill_mode = pb.PREFILL_MODE_LOCAL
                    yield response
        except (InvalidRequestError, DuplicateRequestError, EngineDeadError) as exc:
            error = exc
            await abort_for(context, exc)
        finally:
            trace.close(num_tokens, error)
            log.info(
                "generate done",
                extra={
                    "request_id": request_id,
                    "prompt_tokens": len(engine_input.prompt_token_ids),
                    "generated_tokens": num_tokens,
                    "seconds": round(time.monotonic() - started, 4),
                },
            )

    def _is_remote(self, request: pb.GenerateRequest) -> bool:
        has_address = request.HasField("remote_prefill") and bool(request.remote_prefill.address)
        return self.remote is not None and has_address and (request.sampling.n or 1) == 1

    async def _remote(
        self,
        request: pb.GenerateRequest,
        engine_input: EngineInput,
        context: grpc.aio.ServicerContext,
        trace: RequestTrace,
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.remote is None:
            return
        stream = self.remote.generate(request, engine_input, context.time_remaining(), trace)
        async with contextlib.aclosing(stream):
            async for response in stream:
                yield response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.engine.abort(request.request_id)
        return pb.AbortResponse()

    async def KVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        stream = self.engine.kv_events()
        async with contextlib.aclosing(stream):
            async for batch in stream:
                yield pb.KVEventBatch(
                    snapshot=batch.snapshot,
                    stored=batch.stored,
                    removed=batch.removed,
                    tier_stored=[_tier_segment(e) for e in batch.tiers if e.stored],
                    tier_removed=[_tier_segment(e) for e in batch.tiers if not e.stored],
                )

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        stats, tiers = self.engine.stats(), self.engine.tier_report()
        kv = stats.kv_blocks
        return pb.LoadResponse(
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_blocks=pb.KVBlocks(
                total=kv.num_total, active=kv.num_active, cached=kv.num_cached, free=kv.num_free
            ),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            requests_total=self.requests_total,
            ready=self.ready,
            kv_transfer_bytes_total=self.counters.bytes_total,
            remote_prefills_total=self.counters.remote_prefills_total,
            prefill_fallbacks_total=self.counters.fallbacks_total,
            requests_aborted_total=stats.num_aborted,
            generation_tokens_total=stats.num_generated_tokens,
            steps_by_path=stats.steps_by_path,
            kv_tiers=_tiers_to_proto(tiers) if tiers is not None else [],
            kv_tier_fetched_tokens_total=tiers.stats.fetched_tokens if tiers is not None else 0,
            encoded_sequences_total=stats.num_encoded_sequences,
            encoded_tokens_total=stats.num_encoded_tokens,
            waiting_by_priority=stats.waiting_by_priority,
        )


def _tiers_to_proto(report: TierReport) -> list[pb.KVTier]:
    stats = report.stats
    return [
        pb.KVTier(
            name=tier.name,
            up=tier.up,
            hits=stats.hits[tier.name],
            misses=stats.misses[tier.name],
            read_bytes=stats.bytes_read[tier.name],
            written_bytes=stats.bytes_written[tier.name],
            used_bytes=-1 if tier.used_bytes is None else tier.used_bytes,
            recompute_instead=report.recompute_instead.get(tier.name, 0),
            unavailable=stats.unavailable[tier.name],
            refused=stats.corrupt[tier.name],
            latency_ms=(tier.latency_s or 0.0) * 1000,
            bytes_per_s=tier.bytes_per_s or 0.0,
        )
        for tier in report.tiers
    ]


def _tier_segment(event: TierEvent) -> pb.TierSegment:
    return pb.TierSegment(
        tier=event.tier,
        block_hash=event.last_block,
        first_block=event.first_block,
        num_blocks=event.num_blocks,
        ttl_s=event.ttl_s,
    )
