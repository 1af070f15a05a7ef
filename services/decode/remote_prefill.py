"""Decode replica side of disaggregation: reserve, pull the prompt's KV from a prefill replica, decode.

    reserve blocks (own prefix-cache hits count as held)  ->  Prefill(num_skip_tokens) on the chosen P
    -> header: the first token goes to the client at once  ->  KV chunks, each checked  ->  install
    -> continue with continuous batching beside the other streams.

Any failure before the KV is installed (P unreachable or killed, a bad checksum of the header or of a
chunk, a wrong layout, fingerprint or chunk count, the transfer deadline) frees nothing the client can
see: the reservation is turned into a local request over the prompt plus the first token if it already
went out, which is a continuation of the same stream. Once installed, the request no longer depends on
P. A client that goes away cancels this generator: the Prefill call is cancelled (P aborts) and the
request is released here.

The ipc transport has one more way out: a handle this replica cannot open (P is in another pod, sees
another GPU, or has another /dev/shm) pulls the same KV again over grpc (P's prefix cache makes the
second prefill cheap, though an encoder-decoder request runs its encoder again there; its first token is
ignored, the one already sent stands), and this P gets grpc for IPC_REFUSED_S before ipc is tried with it
again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, replace

import grpc

from services.common import grpc_tls, tracing
from services.common.config import TlsConfig
from services.common.engine_input import cache_written_tokens
from services.common.grpc_auth import TokenSource
from services.common.outputs import FinishReason, TokenLogprob
from services.common.proto_convert import (
    FINISH_FROM_PROTO,
    EngineInput,
    breakpoints_from_proto,
    logprob_from_proto,
)
from services.engine.async_engine import AsyncEngine
from services.engine.kv_export import dtype_name
from services.kvtransfer.chunks import (
    KVAssembler,
    KVTransferFault,
    Layout,
    check_header_checksum,
    encoder_states_from_proto,
)
from services.kvtransfer.ipc_transport import IpcUnavailable
from services.kvtransfer.transport import GrpcReceiver, KVReceiver
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.worker.counters import TransferCounters
from services.worker.outputs import output_to_proto
from services.worker.request_trace import RequestTrace

log = logging.getLogger(__name__)
TRANSFER_FAILURES = (grpc.aio.AioRpcError, KVTransferFault, StopAsyncIteration)
IPC_REFUSED_S = 300.0


@dataclass
class _Transfer:
    trace: RequestTrace
    first: TokenLogprob | None = None
    num_cached_tokens: int = 0  # prompt tokens P served from its prefix cache (it computed the rest)
    num_cache_written_tokens: tuple[int, ...] = ()  # and so wrote down, per cache breakpoint
    num_bytes: int = 0
    seconds: float = 0.0  # Prefill call start -> KV installed (P's queue and prefill included)
    link_seconds: float = 0.0  # header received -> KV installed: the KV's shipping alone
    mode: pb.PrefillMode = pb.PREFILL_MODE_FALLBACK
    transport: str = ""  # what carried the KV that was installed


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncEngine,
        model_fingerprint: str,
        layout: Layout,
        tokens: TokenSource,
        counters: TransferCounters,
        transfer_timeout_s: float,
        receivers: Mapping[str, KVReceiver] | None = None,
        tls: TlsConfig | None = None,
        encoder_width: int = 0,
    ) -> None:
        """`encoder_width`: an encoder-decoder model's d_model, the width of the encoder output a prefill
        replica ships with its KV; 0 for a decoder-only model."""
        self.tls = tls or TlsConfig()
        self.encoder_width = encoder_width
        self.engine = engine
        self.model_fingerprint = model_fingerprint
        self.layout = layout
        self.tokens = tokens
        self.counters = counters
        self.transfer_timeout_s = transfer_timeout_s
        self.receivers: Mapping[str, KVReceiver] = receivers or {"grpc": GrpcReceiver()}
        self.device = engine.device
        self.vocab_size = engine.vocab_size
        self._ipc_refused: dict[str, float] = {}  # prefill address -> until when it gets grpc instead
        self._stubs: dict[str, kv_transfer_pb2_grpc.PrefillStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def generate(
        self,
        request: pb.GenerateRequest,
        engine_input: EngineInput,
        time_remaining: float | None,
        trace: RequestTrace,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The request's stream, or nothing if this replica has no room to reserve (the caller then
        runs it locally). `engine_input` holds the request's checked values. `trace` gets the queue,
        kv_transfer and decode spans."""
        request_id = engine_input.request_id
        num_skip = await self.engine.reserve_remote(engine_input)
        if num_skip is None:
            return
        trace.taken()
        transfer = _Transfer(trace)
        finished = False
        try:
            async for response in self._pull(request, request_id, num_skip, time_remaining, transfer):
                finished = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield response
            if finished:
                return
            trace.decoding()
            async for output in self.engine.outputs(request_id):
                if output.encode_times_ns is not None:  # the fallback encoded the source here
                    trace.encoded(*output.encode_times_ns, len(engine_input.encoder_token_ids))
                response = output_to_proto(output)
                if transfer.mode == pb.PREFILL_MODE_REMOTE:
                    response.num_cached_tokens = transfer.num_cached_tokens
                    response.num_cache_written_tokens[:] = transfer.num_cache_written_tokens
                if output.finished:
                    finished = True
                    response.prefill_mode = transfer.mode
                    response.kv_transfer_bytes = transfer.num_bytes
                    response.kv_transfer_seconds = transfer.seconds
                    response.kv_link_seconds = transfer.link_seconds
                    response.kv_transport = transfer.transport
                yield response
        finally:
            if not finished:
                self.engine.release(request_id)

    async def _pull(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        num_skip: int,
        time_remaining: float | None,
        transfer: _Transfer,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Yields the first token as soon as P sends it, then installs the KV or falls back."""
        remote = request.remote_prefill
        started = time.monotonic()
        timeout = (
            self.transfer_timeout_s
            if time_remaining is None
            else min(time_remaining, self.transfer_timeout_s)
        )
        prefill_request = self._prefill_request(request, request_id, num_skip, self._transport(remote))
        span = transfer.trace.transfer_started(remote.address, num_skip)
        try:
            self._prepare(prefill_request)
        except KVTransferFault as exc:
            self._fall_back(request_id, remote.address, transfer, exc)
            return
        # The prefill replica's "prefill" span continues the trace under the kv_transfer span.
        metadata = tracing.inject(self.tokens.metadata(request_id), span)
        call = self._stub(remote.address).Prefill(prefill_request, metadata=metadata, timeout=timeout)
        try:
            responses = aiter(call)
            try:
                header = await self._header(responses, prefill_request)
                header_at = time.monotonic()
            except TRANSFER_FAILURES as exc:
                self._fall_back(request_id, remote.address, transfer, exc)
                return
            transfer.num_cached_tokens = header.num_cached_tokens
            transfer.num_cache_written_tokens = cache_written_tokens(
                breakpoints_from_proto(request.cache_breakpoints),
                header.num_cached_tokens,
                self.layout.block_size,
            )
            transfer.first = logprob_from_proto(header.first_token)
            first = _first_response(header, request.sampling.HasField("logprobs"))
            first.num_cache_written_tokens[:] = transfer.num_cache_written_tokens
            yield first
            if header.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                reason = FINISH_FROM_PROTO.get(header.finish_reason) or FinishReason.STOP
                self.engine.end_reserved(request_id, reason)  # the first token ended it: nothing to decode
                transfer.trace.transfer_ended("remote", 0, header.num_cached_tokens)
                return
            try:
                try:
                    await self._receive(header, responses, request_id, prefill_request, transfer)
                except IpcUnavailable as exc:
                    call.cancel()  # P lets go of the export it shared
                    self._refuse_ipc(request_id, remote.address, exc)
                    again = self._prefill_request(request, request_id, num_skip, "grpc")
                    await self._pull_again(remote.address, again, metadata, started + timeout, transfer)
                installed_at = time.monotonic()
                transfer.seconds, transfer.link_seconds = installed_at - started, installed_at - header_at
                self.counters.observe_transfer(transfer.seconds)
                transfer.trace.transfer_ended("remote", transfer.num_bytes, transfer.num_cached_tokens)
            except TRANSFER_FAILURES as exc:
                self._fall_back(request_id, remote.address, transfer, exc)
        finally:
            call.cancel()

    def _prefill_request(
        self, request: pb.GenerateRequest, request_id: str, num_skip: int, transport: str
    ) -> kvpb.PrefillRequest:
        return kvpb.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            cache_breakpoints=request.cache_breakpoints,
            encoder_token_ids=request.encoder_token_ids,
            priority=request.priority,
            num_skip_tokens=num_skip,
            model_fingerprint=self.model_fingerprint,
            kv_dtype=dtype_name(self.layout.dtype),
            kv_device=self.layout.device,
            transport=transport,
        )

    def _transport(self, remote: pb.RemotePrefill) -> str:
        """The router's transport, except grpc for a P whose ipc handles could not be opened lately."""
        transport = remote.transport or "grpc"
        if transport == "ipc" and self._ipc_refused.get(remote.address, 0.0) > time.monotonic():
            return "grpc"
        return transport

    def _prepare(self, prefill_request: kvpb.PrefillRequest) -> None:
        receiver = self.receivers.get(prefill_request.transport)
        if receiver is not None:
            receiver.prepare(prefill_request)  # e.g. the torch transport's rendezvous and tag

    def _refuse_ipc(self, request_id: str, address: str, exc: IpcUnavailable) -> None:
        log.warning(
            "ipc handle could not be opened; pulling the KV over grpc",
            extra={"request_id": request_id, "prefill": address, "reason": str(exc)},
        )
        now = time.monotonic()
        for stale in [a for a, until in self._ipc_refused.items() if until <= now]:
            del self._ipc_refused[stale]
        self._ipc_refused[address] = now + IPC_REFUSED_S
        self.counters.ipc_refusals_total += 1

    async def _pull_again(
        self,
        address: str,
        prefill_request: kvpb.PrefillRequest,
        metadata: tuple[tuple[str, str], ...],
        deadline: float,
        transfer: _Transfer,
    ) -> None:
        """The same KV once more, over grpc. P samples a first token again; the one already sent stands
        (the KV is the prompt's alone). A P whose new first token ends the request has no KV to send."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KVTransferFault("the KV transfer deadline passed")
        call = self._stub(address).Prefill(prefill_request, metadata=metadata, timeout=remaining)
        try:
            responses = aiter(call)
            header = await self._header(responses, prefill_request)
            if header.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                raise KVTransferFault("the second prefill ended at its first token: no KV came")
            request_id = prefill_request.request_id
            await self._receive(header, responses, request_id, prefill_request, transfer)
        finally:
            call.cancel()

    async def _header(
        self, responses: AsyncIterator[kvpb.PrefillResponse], request: kvpb.PrefillRequest
    ) -> kvpb.PrefillHeader:
        first = await anext(responses)
        if first.WhichOneof("item") != "header":
            raise KVTransferFault("the prefill stream did not start with a header")
        header = first.header
        check_header_checksum(header)  # first: none of its fields is trusted before
        if header.model_fingerprint != self.model_fingerprint:
            raise KVTransferFault(f"KV from model {header.model_fingerprint!r}, not this replica's")
        check_header(header, request, self.vocab_size, self.encoder_width)
        return header

    async def _receive(
        self,
        header: kvpb.PrefillHeader,
        responses: AsyncIterator[kvpb.PrefillResponse],
        request_id: str,
        prefill_request: kvpb.PrefillRequest,
        transfer: _Transfer,
    ) -> None:
        assembler = KVAssembler(header, self.layout, self.device)
        receiver = self.receivers.get(prefill_request.transport)
        if receiver is None:
            raise KVTransferFault(f"transport {prefill_request.transport!r} is not offered here")
        states, num_state_bytes = None, 0
        try:
            if header.num_encoder_tokens:  # an encoder-decoder request: the encoder output comes first
                item = await anext(responses)
                if item.WhichOneof("item") != "encoder_states":
                    raise KVTransferFault("the encoder states did not follow the header")
                states = encoder_states_from_proto(item.encoder_states, header, self.device)
                num_state_bytes = len(item.encoder_states.data)
            while not assembler.is_complete:
                item = await anext(responses)
                if item.WhichOneof("item") != "chunk":
                    raise KVTransferFault("a second header in the prefill stream")
                assembler.expect(item.chunk)
                assembler.add(item.chunk, await receiver.receive(prefill_request, item.chunk, self.layout))
                # ipc asked of a P in another domain comes as bytes, as grpc's does
                ipc_as_bytes = prefill_request.transport == "ipc" and not item.chunk.HasField("ipc")
                transfer.transport = "grpc" if ipc_as_bytes else prefill_request.transport
        finally:
            receiver.release(prefill_request)  # complete or not: nothing of this transfer is held
        export = replace(assembler.export(), encoder_states=states)
        if transfer.first is None:
            raise KVTransferFault("KV arrived without a first token")
        self.engine.install_remote(request_id, transfer.first, export)
        transfer.num_bytes = assembler.num_bytes + num_state_bytes
        transfer.mode = pb.PREFILL_MODE_REMOTE
        self.counters.bytes_total += transfer.num_bytes
        self.counters.remote_prefills_total += 1

    def _fall_back(self, request_id: str, address: str, transfer: _Transfer, exc: BaseException) -> None:
        reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc) or type(exc).__name__
        log.warning(
            "remote prefill failed; recomputing here",
            extra={"request_id": request_id, "prefill": address, "reason": reason},
        )
        self.counters.fallbacks_total += 1
        transfer.mode = pb.PREFILL_MODE_FALLBACK
        transfer.trace.transfer_ended("fallback", failure=reason)
        self.engine.resume_local(request_id, transfer.first)

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.PrefillStub:
        stub = self._stubs.get(address)
        if stub is None:
            options = [("grpc.max_receive_message_length", 64 << 20)]
            channel = grpc_tls.channel(address, self.tls, options)
            self._channels.append(channel)
            stub = self._stubs[address] = kv_transfer_pb2_grpc.PrefillStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _first_response(header: kvpb.PrefillHeader, with_logprobs: bool) -> pb.GenerateResponse:
    first = header.first_token
    return pb.GenerateResponse(
        index=0,
        token_ids=[first.token_id],
        logprobs=[first] if with_logprobs else [],
        finish_reason=header.finish_reason,
        num_prompt_tokens=header.num_prompt_tokens,
        num_cached_tokens=header.num_cached_tokens,
        prefill_mode=pb.PREFILL_MODE_REMOTE if header.finish_reason else pb.PREFILL_MODE_UNSPECIFIED,
    )


def check_header(
    header: kvpb.PrefillHeader, request: kvpb.PrefillRequest, vocab_size: int, encoder_width: int = 0
) -> None:
    """A prefill replica's header checked against the request it answers, before anything is allocated
    for it: the KV must start where this replica asked, cover exactly the rest of the prompt, come in a
    possible number of chunks, and follow a first token from the vocabulary; an encoder-decoder request's
    encoder output must cover its source at this model's width (`encoder_width`, its d_model)."""
    num_prompt = len(request.prompt_token_ids)
    if header.num_prompt_tokens != num_prompt or header.first_token_position != request.num_skip_tokens:
        raise KVTransferFault(
            f"the header covers a prompt of {header.num_prompt_tokens} tokens from position "
            f"{header.first_token_position}; asked for {num_prompt} from {request.num_skip_tokens}"
        )
    if not 0 <= header.first_token.token_id < vocab_size:
        raise KVTransferFault(f"first token {header.first_token.token_id} is outside the vocabulary")
    if header.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        return  # the first token ended the request: no KV follows
    num_source = len(request.encoder_token_ids)
    expected = (num_source, encoder_width if num_source else 0)
    if (header.num_encoder_tokens, header.encoder_width if header.num_encoder_tokens else 0) != expected:
        raise KVTransferFault(
            f"the header promises encoder states of {header.num_encoder_tokens} x {header.encoder_width}; "
            f"{expected[0]} x {expected[1]} are due"
        )
    num_kv = num_prompt - request.num_skip_tokens
    if header.num_kv_tokens != num_kv or not 1 <= header.num_chunks <= num_kv:
        raise KVTransferFault(
            f"the header promises {header.num_kv_tokens} KV tokens in {header.num_chunks} chunks; "
            f"{num_kv} tokens in 1..{num_kv} chunks are due"
        )
