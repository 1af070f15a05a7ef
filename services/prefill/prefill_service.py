"""The prefill replica's Prefill RPC: run a prompt, sample its first token, ship the KV to the caller.

The decode replica that calls has already reserved blocks for the prompt. This side refuses a caller
with another model or KV dtype (FAILED_PRECONDITION, before any work), runs the prompt through its own
engine (chunked prefill and prefix caching as usual), and answers with one PrefillHeader and then the
KV chunks of every prompt position from `num_skip_tokens` on (an encoder-decoder request's encoder
output goes between the two). If the first token already ends the request, the header says so and no KV
follows. The header is sealed with a CRC-32 of its fields (the chunks carry their own). The request's
values are range-checked first (INVALID_ARGUMENT), and a request ID this process's engine already runs is
refused (ALREADY_EXISTS) without touching the running one; the ID is held only while the engine runs the
prompt, so a decode replica that pulls the same KV again (the ipc transport's way out) is not refused by
the call it has just cancelled. A cancelled call (the decode side or the client went away, or the
deadline passed) aborts the request here, so its blocks go back to the pool.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind, set_span_in_context

from services.common import tracing
from services.common.engine_input import check_unique
from services.common.errors import DuplicateRequestError, EngineDeadError, InvalidRequestError
from services.common.grpc_server import abort_for
from services.common.outputs import TokenLogprob
from services.common.proto_convert import (
    FINISH_TO_PROTO,
    EngineInput,
    engine_input_from_proto,
    logprob_to_proto,
)
from services.engine.async_engine import AsyncEngine
from services.engine.core import RequestOutput
from services.engine.kv_export import dtype_name
from services.kvtransfer.chunks import (
    KVTransferFault,
    Layout,
    encoder_states_to_proto,
    num_chunks,
    seal_header,
)
from services.kvtransfer.transport import GrpcSender, KVSender
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc
from services.worker.counters import TransferCounters
from services.worker.request_trace import encode_span

log = logging.getLogger(__name__)


class PrefillService(kv_transfer_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        model_fingerprint: str,
        layout: Layout,
        counters: TransferCounters,
        senders: dict[str, KVSender] | None = None,
        in_flight: set[str] | None = None,
    ) -> None:
        """`in_flight`: the request IDs this process's engine runs now, shared with its Worker service."""
        self.engine = engine
        self.model_fingerprint = model_fingerprint
        self.layout = layout
        self.counters = counters
        self.senders: dict[str, KVSender] = senders if senders is not None else {"grpc": GrpcSender()}
        self.vocab_size = engine.vocab_size
        self.in_flight: set[str] = in_flight if in_flight is not None else set()

    async def Prefill(
        self, request: kvpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvpb.PrefillResponse]:
        try:
            engine_input = engine_input_from_proto(request, self.vocab_size)
        except InvalidRequestError as exc:
            await abort_for(context, exc)
        refusal = self._refusal(request)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        started = time.monotonic()
        num_bytes = 0
        # This replica's span of the request's trace, under the decode side's kv_transfer span: the
        # prompt's prefill, then the KV shipped. Never made current: this generator yields.
        span = tracing.start_span(
            "prefill",
            tracing.extract(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes={
                "kvrelay.request_id": request.request_id,
                "kvrelay.prompt_tokens": len(request.prompt_token_ids),
                "kvrelay.skipped_tokens": request.num_skip_tokens,
                "kvrelay.transport": request.transport or "grpc",
            },
        )
        error: BaseException | None = None
        try:
            output = await self._first_output(engine_input, request)
            if span.is_recording():
                span.add_event("first_token", {"kvrelay.cached_tokens": output.num_cached_tokens})
                if output.encode_times_ns is not None:  # an encoder-decoder request's encoder pass
                    num_source = len(engine_input.encoder_token_ids)
                    encode_span(
                        set_span_in_context(span), request.request_id, *output.encode_times_ns, num_source
                    )
            sender = self.senders[request.transport or "grpc"]
            header = self._header(request, output, sender.chunk_bytes(request))
            yield kvpb.PrefillResponse(header=header)
            if output.kv is not None and output.kv.encoder_states is not None:
                states = encoder_states_to_proto(output.kv.encoder_states)
                num_bytes += len(states.data)
                yield kvpb.PrefillResponse(encoder_states=states)
            if output.kv is not None:
                async with contextlib.aclosing(sender.chunks(request, output.kv, self.layout)) as chunks:
                    async for chunk in chunks:
                        num_bytes += chunk.num_tokens * self.layout.bytes_per_token
                        if chunk.index + 1 == header.num_chunks:
                            # Counted as the last chunk is handed over: the caller may hang up as soon
                            # as it has it, and this generator is then closed at the yield below.
                            self.counters.bytes_total += num_bytes
                            self.counters.remote_prefills_total += 1
                        yield kvpb.PrefillResponse(chunk=chunk)
        except (InvalidRequestError, DuplicateRequestError, EngineDeadError, KVTransferFault) as exc:
            error = exc
            await abort_for(context, exc, unavailable=(KVTransferFault,))
        finally:
            if span.is_recording():
                span.set_attribute("kvrelay.kv_bytes", num_bytes)
            tracing.finish(span, error)
            log.info(
                "prefill done",
                extra={
                    "request_id": request.request_id,
                    "prompt_tokens": len(request.prompt_token_ids),
                    "skipped_tokens": request.num_skip_tokens,
                    "kv_bytes": num_bytes,
                    "seconds": round(time.monotonic() - started, 4),
                },
            )

    def _refusal(self, request: kvpb.PrefillRequest) -> str | None:
        if request.model_fingerprint != self.model_fingerprint:
            return f"model_fingerprint {request.model_fingerprint!r} is not this replica's"
        if request.kv_dtype != dtype_name(self.layout.dtype):
            return f"KV dtype {request.kv_dtype!r} is not this replica's {dtype_name(self.layout.dtype)}"
        if (request.kv_device or "cpu") != self.layout.device:
            return f"KV device {request.kv_device or 'cpu'!r} is not this replica's {self.layout.device!r}"
        if (request.transport or "grpc") not in self.senders:
            return f"transport {request.transport!r} is not offered here"
        if request.num_skip_tokens >= len(request.prompt_token_ids):
            return "num_skip_tokens must leave at least one prompt token"
        return None

    async def _first_output(self, engine_input: EngineInput, request: kvpb.PrefillRequest) -> RequestOutput:
        """The engine's one output for the prompt (its first token and KV), under the request's ID held
        in `in_flight` until then (DuplicateRequestError if another request holds it)."""
        request_id = engine_input.request_id
        check_unique(request_id, self.in_flight)
        self.in_flight.add(request_id)
        try:
            stream = self.engine.generate_checked(engine_input, export_kv_from=request.num_skip_tokens)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    return output
        finally:
            self.in_flight.discard(request_id)
        raise EngineDeadError("the engine ended the prefill without a token")

    def _header(
        self, request: kvpb.PrefillRequest, output: RequestOutput, chunk_bytes: int
    ) -> kvpb.PrefillHeader:
        first = output.logprobs[0] if output.logprobs else TokenLogprob(output.new_token_ids[0], 0.0)
        num_kv = 0 if output.kv is None else output.kv.kv.shape[1]
        states = None if output.kv is None else output.kv.encoder_states
        header = kvpb.PrefillHeader(
            model_fingerprint=self.model_fingerprint,
            layout=self.layout.to_proto(),
            first_token=logprob_to_proto(first),
            finish_reason=FINISH_TO_PROTO[output.finish_reason],
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            first_token_position=request.num_skip_tokens,
            num_kv_tokens=num_kv,
            num_chunks=num_chunks(request.num_skip_tokens, num_kv, self.layout, chunk_bytes),
        )
        if states is not None:  # an encoder-decoder request's encoder output follows the header
            header.num_encoder_tokens, header.encoder_width = states.shape
            header.encoder_dtype = dtype_name(states.dtype)
        return seal_header(header)
