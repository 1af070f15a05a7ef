"""The public gRPC API's servicer (protos/kvrelay/v1/public.proto): Chat and Generate, streamed.

Each RPC runs the pieces its HTTP twin runs: the request is read in the HTTP schema's terms
(requests.py), the prompt is rendered and tokenized by text/prompts.py, the admission gate
(admission/gate.py) applies the context checks and sampling validation (`admit`), then the call
tenant's quotas and a slot in the fair queue (`start`), and generation.py produces the text events
that become stream messages here. Every refusal happens before the backend sees the request. Over
quota and saturation are RESOURCE_EXHAUSTED, with the wait in the trailing metadata `retry-after`
(seconds); a quota store that is down with quotas failing closed is UNAVAILABLE.

Errors go through `errors.describe` (the codec's one mapping from an exception to a wire error), then
from its HTTP status to a gRPC code (GRPC_CODES). A client that cancels cancels the handler's task; the
generation stream is closed in `finally`, which aborts the request behind the codec. Metrics and the
access log get the same per-request stats as HTTP, under the protocols "grpc.chat" and "grpc.generate".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from opentelemetry.trace import SpanKind

from services.codec.admission.auth import rpc_tenant
from services.codec.admission.errors import AdmissionRefusedError, OverloadedError, RateLimitedError
from services.codec.admission.gate import SamplingSource
from services.codec.backend import results
from services.codec.errors import describe, is_expected
from services.codec.generation import SampleFinished, TextDelta, Usage
from services.codec.grpc_public.requests import chat_request, completion_request
from services.codec.metrics import STATUS_CLIENT_CLOSED, RequestStats
from services.codec.middleware import log_access, new_request_ids
from services.codec.protocols.output import (
    AssistantEvent,
    Constrained,
    OutputPlan,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStarted,
    assistant_events,
    is_tool_finish,
    prepare,
)
from services.codec.protocols.result_key import result_key_if_asked
from services.codec.protocols.service_tier import HEADER as PRIORITY_HEADER
from services.codec.protocols.service_tier import resolve_class
from services.codec.session import SESSION_HEADER, session_key
from services.codec.state import CodecState
from services.codec.text.prompts import encode_decoder_prompt, encode_prompt
from services.common import priority, tracing
from services.common.grpc_auth import REQUEST_ID_KEY
from services.common.outputs import FinishReason, TokenLogprob
from services.common.tenants import open_tenant
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
PROTOCOLS = {"Chat": "grpc.chat", "Generate": "grpc.generate"}  # method → metrics/access-log protocol
STATUS_OK = 200
RETRY_AFTER_KEY = "retry-after"  # trailing metadata on RESOURCE_EXHAUSTED: seconds to wait

# The HTTP status `describe` gives an error → the gRPC code it becomes; anything else is INTERNAL.
GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    STATUS_CLIENT_CLOSED: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH_REASONS = {FinishReason.STOP: pb.SampleFinish.STOP, FinishReason.LENGTH: pb.SampleFinish.LENGTH}

ResponseT = TypeVar("ResponseT", pb.ChatResponse, pb.TextGenerateResponse)


@dataclass(frozen=True)
class PreparedRequest:
    """A request read, checked and tokenized: what admission needs."""

    fields: SamplingSource
    prompt_token_ids: list[int]
    max_tokens: int | None
    logprobs: int | None
    prompt_param: str
    session_key: str = ""
    plan: OutputPlan = field(default_factory=OutputPlan)
    decoder_prompt_ids: list[int] | None = None  # an encoder-decoder model's (gate.split_encoder_input)


class InferenceServicer(public_pb2_grpc.InferenceServicer):
    """kvrelay.v1.Inference over one codec's state (shared with its HTTP app)."""

    def __init__(self, state: CodecState) -> None:
        self._state = state

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> None:
        session_id = _metadata_value(context, SESSION_HEADER)
        await self._serve(context, "Chat", pb.ChatResponse, lambda: self._prepare_chat(request, session_id))

    async def Generate(self, request: pb.TextGenerateRequest, context: grpc.aio.ServicerContext) -> None:
        session_id = _metadata_value(context, SESSION_HEADER)
        await self._serve(
            context,
            "Generate",
            pb.TextGenerateResponse,
            lambda: self._prepare_generate(request, session_id),
        )

    async def _prepare_chat(self, request: pb.ChatRequest, session_id: str | None) -> PreparedRequest:
        state = self._state
        with tracing.span("parse"):
            body = chat_request(request, state.identity.model_name)
        state.check_model(body.model)
        body.check_supported()
        messages = body.template_messages()
        prompt_ids, plan = await prepare(
            state, messages, tools=body.toolset(), thinking=body.thinking(), constraint=body.constraint()
        )
        tenant = rpc_tenant().tenant_id
        key = session_key(
            header=session_id, model=state.identity.model_name, messages=messages, tenant=tenant
        )
        fields = Constrained(body, plan.constraint)
        return PreparedRequest(
            fields, prompt_ids, body.requested_max_tokens, body.num_top_logprobs, "messages", key, plan
        )

    async def _prepare_generate(
        self, request: pb.TextGenerateRequest, session_id: str | None
    ) -> PreparedRequest:
        state = self._state
        with tracing.span("parse"):
            body = completion_request(request, state.identity.model_name)
        state.check_model(body.model)
        body.check_supported()
        param = "prompt" if request.prompt else "prompt_token_ids"
        info = await state.info.get()
        prompt_ids = await encode_prompt(
            body.single_prompt(),
            state.encoder,
            param,
            state.vocab_size,
            empty_text_ok=not info.encoder_decoder,
        )
        decoder_ids = await encode_decoder_prompt(body.decoder_prompt, state.encoder, state.vocab_size)
        tenant = rpc_tenant().tenant_id
        key = session_key(header=session_id, tenant=tenant)  # a plain prompt has no turns: metadata only
        return PreparedRequest(
            body, prompt_ids, body.max_tokens, body.logprobs, param, key, decoder_prompt_ids=decoder_ids
        )

    async def _serve(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        response_cls: type[ResponseT],
        prepare: Callable[[], Awaitable[PreparedRequest]],
    ) -> None:
        """Runs one RPC: request ID, the stream, the error status, metrics and the access log."""
        request_id, backend_request_id = new_request_ids(_metadata_value(context, REQUEST_ID_KEY))
        # which release answered, as over HTTP
        metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_KEY, request_id),)
        await context.send_initial_metadata(metadata + self._state.identity.release_headers)
        stats = RequestStats(request_id=request_id, protocol=PROTOCOLS[method], tenant=rpc_tenant())
        status = STATUS_OK
        route = f"/{SERVICE_NAME}/{method}"
        # The root span of the request's trace; as on HTTP, a client's trace context is not followed.
        attributes = {"rpc.system": "grpc", "rpc.method": route, "kvrelay.request_id": request_id}
        with tracing.span(route.lstrip("/"), kind=SpanKind.SERVER, attributes=attributes) as span:
            try:
                prepared = await prepare()
                await self._stream(context, stats, backend_request_id, prepared, response_cls)
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                status = STATUS_CLIENT_CLOSED
                raise
            except AdmissionRefusedError as exc:
                status = exc.status
                retry_after = ((RETRY_AFTER_KEY, str(exc.retry_after_s)),)
                await context.abort(_refusal_code(exc), str(exc), trailing_metadata=retry_after)
            except Exception as exc:
                error = describe(exc, request_id)
                status = error.status
                if not is_expected(exc):
                    logger.error(
                        "request failed: %s",
                        type(exc).__name__,
                        exc_info=exc,
                        extra={"request_id": request_id},
                    )
                await context.abort(GRPC_CODES.get(error.status, grpc.StatusCode.INTERNAL), error.message)
            finally:
                self._state.metrics.observe_request(stats, status)
                log_access(stats, status, method="gRPC", route=route, inward_request_id=backend_request_id)
                span.set_attribute("kvrelay.status", status)

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        stats: RequestStats,
        backend_request_id: str,
        prepared: PreparedRequest,
        response_cls: type[ResponseT],
    ) -> None:
        tenant = stats.tenant or open_tenant()
        gate = self._state.gate
        stats.priority_class = resolve_class(None, _metadata_value(context, PRIORITY_HEADER), tenant)
        generation_request = await gate.admit(
            stats,
            prepared.fields,
            prepared.prompt_token_ids,
            request_id=backend_request_id,
            max_tokens=prepared.max_tokens,
            logprobs=prepared.logprobs,
            prompt_param=prepared.prompt_param,
            timeout_s=self._timeout_s(context),
            session_key=prepared.session_key,
            cache_salt=tenant.cache_salt,
            decoder_prompt_ids=prepared.decoder_prompt_ids,
            priority=priority.BY_NAME[stats.priority_class],
        )
        asked = _metadata_value(context, results.REQUEST_HEADER) or ""
        key = await result_key_if_asked(
            asked, self._state, stats, tenant.tenant_id, generation_request, prepared.plan
        )
        generation = await gate.start(tenant.tenant_id, generation_request, stats, result_key=key)
        trailing = [(PRIORITY_HEADER, stats.priority_class)]  # the class that served it, as over HTTP
        if stats.result_cache is not None:  # hit, miss or skip, as HTTP's x-kvrelay-result-cache header
            trailing.append((results.RESPONSE_HEADER, stats.result_cache))
        context.set_trailing_metadata(tuple(trailing))
        try:
            events = assistant_events(generation, prepared.plan)
            async with aclosing(response_messages(events, response_cls)) as messages:
                async for message in messages:
                    await context.write(message)
        finally:
            await generation.aclose()  # aborts the request behind us unless it already finished

    def _timeout_s(self, context: grpc.aio.ServicerContext) -> float:
        """The server's request timeout, shortened by the client's deadline."""
        remaining = context.time_remaining()
        configured = self._state.request_timeout_s
        return configured if remaining is None else min(configured, remaining)


async def response_messages(
    generation: AsyncIterable[AssistantEvent], response_cls: type[ResponseT]
) -> AsyncGenerator[ResponseT, None]:
    """Stream messages for a generation's events. A sample's finish message is held until the next
    event, so that the last one also carries the usage (which follows the last sample's finish)."""
    held: ResponseT | None = None
    async for event in generation:
        if isinstance(event, Usage):
            final = held if held is not None else response_cls()
            final.usage.CopyFrom(usage_message(event))
            held = None
            yield final
            continue
        if held is not None:
            yield held
            held = None
        if isinstance(event, TextDelta):
            yield response_cls(
                index=event.index,
                text=event.text,
                logprobs=[logprob_message(item) for item in event.logprobs],
            )
        elif isinstance(event, SampleFinished):
            held = response_cls(index=event.index, finish=finish_message(event))
        elif isinstance(event, ReasoningDelta):
            yield pb.ChatResponse(index=event.index, reasoning=event.text)  # type: ignore[misc]
        elif isinstance(event, ToolCallStarted):
            call = pb.ToolCallDelta(call_index=event.call_index, id=event.call_id, name=event.name)
            yield pb.ChatResponse(index=event.index, tool_calls=[call])  # type: ignore[misc]
        elif isinstance(event, ToolCallDelta):
            call = pb.ToolCallDelta(call_index=event.call_index, arguments=event.fragment)
            yield pb.ChatResponse(index=event.index, tool_calls=[call])  # type: ignore[misc]
    if held is not None:
        yield held


def finish_message(event: SampleFinished) -> pb.SampleFinish:
    reason = pb.SampleFinish.TOOL_CALLS if is_tool_finish(event) else _FINISH_REASONS[event.reason]
    return pb.SampleFinish(reason=reason, matched_stop=event.stop or "", num_tokens=event.num_tokens)


def usage_message(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.num_prompt_tokens,
        completion_tokens=usage.num_completion_tokens,
        cached_tokens=usage.num_cached_tokens,
    )


def logprob_message(item: TokenLogprob) -> pb.OutputLogprob:
    return pb.OutputLogprob(
        token=item.token,
        token_id=item.token_id,
        logprob=item.logprob,
        top_logprobs=[
            pb.OutputLogprob.Alternative(token=text, token_id=token_id, logprob=logprob)
            for text, (token_id, logprob) in zip(item.top_tokens, item.top, strict=True)
        ],
    )


def _refusal_code(exc: AdmissionRefusedError) -> grpc.StatusCode:
    """Over quota and a full queue: RESOURCE_EXHAUSTED; the quota store down (fail closed): UNAVAILABLE."""
    if isinstance(exc, RateLimitedError | OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.UNAVAILABLE


def _metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for item_key, value in context.invocation_metadata() or ():
        if item_key == key:
            return value if isinstance(value, str) else None
    return None
