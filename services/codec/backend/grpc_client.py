"""The codec's Backend over the internal gRPC API, talking to the router. No torch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.codec.backend.protocol import (
    BackendFailedError,
    BackendInfo,
    BackendRejectedError,
    BackendUnavailableError,
    GenerationRequest,
    ServiceStatus,
    TokenDelta,
)
from services.common import grpc_tls, tracing
from services.common.config import TlsConfig
from services.common.grpc_auth import TokenSource
from services.common.grpc_server import is_busy
from services.common.proto_convert import (
    FINISH_FROM_PROTO,
    breakpoints_to_proto,
    logprob_from_proto,
    sampling_to_proto,
)
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

INFO_TIMEOUT_S = 3.0
UNAVAILABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
)


class GrpcBackend:
    def __init__(self, router_address: str, tokens: TokenSource, tls: TlsConfig | None = None) -> None:
        self.router_address = router_address
        self.tokens = tokens
        self.channel = grpc_tls.channel(router_address, tls or TlsConfig())
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.router = worker_pb2_grpc.RouterStub(self.channel)

    async def info(self) -> BackendInfo:
        try:
            info = await self.worker.Info(
                pb.InfoRequest(), metadata=self.tokens.metadata(), timeout=INFO_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise BackendUnavailableError(f"router at {self.router_address}: {exc.code().name}") from exc
        return BackendInfo(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            model_fingerprint=info.model_fingerprint,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            vocab_size=info.vocab_size,
            numerics=info.numerics or "default",
            encoder_decoder=info.encoder_decoder,
            decoder_start_token_id=info.decoder_start_token_id,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        message = pb.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_proto(request.sampling),
            session_key=request.session_key,
            cache_salt=request.cache_salt,
            priority=request.priority,
            cache_breakpoints=breakpoints_to_proto(request.cache_breakpoints),
            encoder_token_ids=request.encoder_token_ids,
        )
        # The request's trace goes on in the router: the current span (the request's) is its parent.
        metadata = tracing.inject(self.tokens.metadata(request.request_id))
        call = self.worker.Generate(message, metadata=metadata, timeout=request.timeout_s)
        started = False
        try:
            async for response in call:
                started = True
                yield _delta(response)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or exc.code().name
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise BackendRejectedError(details) from exc
            if (code in UNAVAILABLE or is_busy(exc)) and not started:  # busy: every replica's queue full
                raise BackendUnavailableError(details) from exc
            raise BackendFailedError(details) from exc
        finally:
            call.cancel()  # closing early aborts the request behind us

    async def statuses(self) -> list[ServiceStatus]:
        md = self.tokens.metadata()
        try:
            load = await self.worker.Load(pb.LoadRequest(), metadata=md, timeout=INFO_TIMEOUT_S)
            replicas = await self.router.Replicas(pb.ReplicasRequest(), metadata=md, timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return [ServiceStatus(name="router", role="router", address=self.router_address, ready=False)]
        out = [
            ServiceStatus(
                name="router",
                role="router",
                address=self.router_address,
                ready=load.ready,
                running=load.running,
                waiting=load.waiting,
                requests_total=load.requests_total,
            )
        ]
        out += [_replica_status(r) for r in replicas.replicas]
        return out

    async def close(self) -> None:
        await self.channel.close()


def _delta(response: pb.GenerateResponse) -> TokenDelta:
    return TokenDelta(
        index=response.index,
        token_ids=list(response.token_ids),
        logprobs=[logprob_from_proto(lp) for lp in response.logprobs],
        finish_reason=FINISH_FROM_PROTO.get(response.finish_reason),
        num_prompt_tokens=response.num_prompt_tokens,
        num_cached_tokens=response.num_cached_tokens,
        num_cache_written_tokens=tuple(response.num_cache_written_tokens),
    )


def _replica_status(replica: pb.Replica) -> ServiceStatus:
    load, kv = replica.load, replica.load.kv_blocks
    return ServiceStatus(
        name=replica.name,
        role=replica.role,
        address=replica.address,
        ready=replica.ready,
        running=load.running,
        waiting=load.waiting,
        requests_total=load.requests_total,
        kv_blocks={"total": kv.total, "active": kv.active, "cached": kv.cached, "free": kv.free},
        prefix_cache={"queries": load.prefix_cache_queries, "hits": load.prefix_cache_hits},
        kv_transfer_bytes_total=load.kv_transfer_bytes_total,
        remote_prefills_total=load.remote_prefills_total,
        prefill_fallbacks_total=load.prefill_fallbacks_total,
        steps_by_path=dict(load.steps_by_path),
        kv_tiers=[{f.name: getattr(tier, f.name) for f in tier.DESCRIPTOR.fields} for tier in load.kv_tiers],
        kv_tier_fetched_tokens_total=load.kv_tier_fetched_tokens_total,
        encoded_sequences_total=load.encoded_sequences_total,
        encoded_tokens_total=load.encoded_tokens_total,
        **_weights_status(replica),
    )


def _weights_status(replica: pb.Replica) -> dict[str, Any]:
    """What the replica serves its model from, once the router has its info."""
    if not replica.HasField("info") or not replica.info.weights:
        return {}
    info = replica.info
    return {
        "weights": info.weights,
        "small_step_max_tokens": info.small_step_max_tokens or None,
        "weight_bytes": info.weight_bytes,
        "numerics": info.numerics or "default",
    }
