"""The internal Worker API over the engine: Generate streams token IDs, Abort, Info and Load.

This is the colocated worker (prefill and decode in one engine); the disaggregated roles extend it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.common.errors import InvalidRequestError
from services.common.grpc_auth import request_id_of
from services.common.proto_convert import FINISH_TO_PROTO, sampling_from_proto
from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.core import RequestOutput
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, info: pb.InfoResponse) -> None:
        self.engine = engine
        self.info = info
        self.requests_total = 0
        self.ready = False

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or request_id_of(context)
        started = time.monotonic()
        self.requests_total += 1
        num_tokens = 0
        try:
            params = sampling_from_proto(request.sampling)
            stream = self.engine.generate(
                request_id,
                list(request.prompt_token_ids),
                params,
                priority=request.priority,
                extra_key=bytes(request.tenant_salt),
            )
            async with contextlib.aclosing(stream):
                async for output in stream:
                    num_tokens += len(output.new_token_ids)
                    yield _to_proto(output)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            log.info(
                "generate done",
                extra={
                    "request_id": request_id,
                    "prompt_tokens": len(request.prompt_token_ids),
                    "generated_tokens": num_tokens,
                    "seconds": round(time.monotonic() - started, 4),
                },
            )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.engine.abort(request.request_id)
        return pb.AbortResponse()

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        stats = self.engine.stats()
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
        )


def _to_proto(output: RequestOutput) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in output.logprobs or ()
    ]
    reason = output.finish_reason.value if output.finish_reason is not None else None
    return pb.GenerateResponse(
        index=output.index,
        token_ids=output.new_token_ids,
        logprobs=logprobs,
        finish_reason=FINISH_TO_PROTO[reason],
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )
