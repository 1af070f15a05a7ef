"""What the text protocols share: admission and start, the response envelope, usage, collecting a
non-streamed result, and streaming with OpenAI's in-band error event. `admit_and_start` serves every
HTTP protocol (Anthropic's Messages too); `admit` and `start_generation` are protocol-neutral, and the
public gRPC API (grpc_public.py), which reuses these schemas, calls them too.

Admission order, every refusal before any response byte:

    admit              context length and sampling checks          400 (the backend never sees it)
    start_generation   quotas (tenant and global, per minute)      429 + Retry-After
                       a concurrency slot, in the fair queue       503 (529 on /v1/messages) when full
                       the backend, waiting for the first token

The quota reservation and the slot are given back when the generation stream closes (limits.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fastapi import Request

from services.codec.disconnect import unless_client_leaves
from services.codec.errors import describe
from services.codec.generation import (
    GenerationRequest,
    GenerationStream,
    SampleFinished,
    TextDelta,
    TokenLogprob,
    Usage,
    build_sampling,
)
from services.codec.metrics import RequestStats, StreamOutcome
from services.codec.sse import EventStreamResponse, encode_event
from services.codec.state import CodecState, backend_request_id, codec_state, request_id
from services.codec.tenancy import tenant_of
from services.common import tracing


class SamplingSource(Protocol):
    """What admission reads from a request body (OpenAI's SamplingFields, Anthropic's MessagesRequest)."""

    def sampling_kwargs(self) -> dict[str, Any]: ...

    def stop_strings(self) -> tuple[str, ...]: ...


async def admit_and_start(
    request: Request,
    state: CodecState,
    stats: RequestStats,
    fields: SamplingSource,
    prompt_token_ids: list[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    session_key: str = "",
) -> GenerationStream:
    """Context checks and sampling validation, quotas, a slot, then the backend (see the module doc).
    Every refusal happens before any byte: InvalidRequestError, or an AdmissionRefusedError
    (limits_errors.py) that the route answers with `refusal_response`."""
    tenant = tenant_of(request)
    generation_request = await admit(
        state,
        stats,
        fields,
        prompt_token_ids,
        request_id=backend_request_id(request),
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_param=prompt_param,
        timeout_s=state.request_timeout_s,
        session_key=session_key,
        tenant_salt=tenant.cache_salt,
    )
    # A client that leaves while queued, or while waiting for its first token, is dropped there and then.
    return await unless_client_leaves(
        request.receive, lambda: start_generation(state, tenant.tenant_id, generation_request, stats)
    )


async def start_generation(
    state: CodecState, tenant_id: str, generation_request: GenerationRequest, stats: RequestStats
) -> GenerationStream:
    """Quotas (429), then a concurrency slot in the fair queue (503/529 when saturated), then the
    backend. The reservation is for prompt + n × max_tokens; it and the slot are given back when the
    stream closes, or here if starting fails (limits.py). Time spent queued counts against the
    request's timeout."""
    sampling = generation_request.sampling
    num_tokens = len(generation_request.prompt_token_ids) + sampling.n * sampling.max_tokens
    with tracing.span("admission", attributes={"kvrelay.tenant": tenant_id}) as span:
        lease = await state.limits.enter(tenant_id, num_tokens, generation_request.timeout_s)
        if lease.waited_s is not None:
            span.set_attribute("kvrelay.queue_wait_ms", round(lease.waited_s * 1000, 3))
    try:
        waited_s = lease.waited_s
        if waited_s is not None:
            stats.queue_wait_s = waited_s
            if generation_request.timeout_s is not None:
                remaining_s = max(generation_request.timeout_s - waited_s, 0.001)
                generation_request = replace(generation_request, timeout_s=remaining_s)
        return await state.generator.start(generation_request, stats, on_close=lease.close)
    except BaseException:
        await lease.close(None)  # does nothing when the failed stream's close already gave it back
        raise


async def admit(
    state: CodecState,
    stats: RequestStats,
    fields: SamplingSource,
    prompt_token_ids: list[int],
    *,
    request_id: str,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    timeout_s: float | None,
    session_key: str = "",
    tenant_salt: bytes | None = None,
) -> GenerationRequest:
    """The request to start, after the context checks and sampling validation (protocol-neutral: the
    public gRPC API uses it too). Refusals raise InvalidRequestError subclasses. `tenant_salt` comes
    from the authenticated tenant only (None: the tenant on `stats`, see generation.py)."""
    num_prompt_tokens = len(prompt_token_ids)
    resolved = await state.admission.resolve_max_tokens(num_prompt_tokens, max_tokens, prompt_param)
    info = await state.admission.backend_info()
    sampling = build_sampling(
        fields.sampling_kwargs(), max_tokens=resolved, logprobs=logprobs, vocab_size=info.vocab_size
    )
    stats.num_prompt_tokens = num_prompt_tokens
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        stop=fields.stop_strings(),
        timeout_s=timeout_s,
        session_key=session_key,
        tenant_salt=tenant_salt,
    )


@dataclass(frozen=True)
class Envelope:
    """The fields every response object and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, prefix: str, object_name: str, state: CodecState) -> Envelope:
        identity = state.identity
        return cls(
            f"{prefix}-{uuid.uuid4().hex}",
            object_name,
            int(time.time()),
            identity.model_name,
            identity.system_fingerprint,
        )

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            **extra,
        }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.num_prompt_tokens,
        "completion_tokens": usage.num_completion_tokens,
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.num_cached_tokens},
    }


@dataclass
class CollectedSample:
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: SampleFinished | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


async def collect(generation: GenerationStream, num_samples: int) -> tuple[list[CollectedSample], Usage]:
    """Runs a generation to the end for a non-streamed response."""
    samples = [CollectedSample() for _ in range(num_samples)]
    usage = Usage(0, 0, 0)
    async for event in generation:
        if isinstance(event, TextDelta):
            samples[event.index].text_parts.append(event.text)
            samples[event.index].logprobs.extend(event.logprobs)
        elif isinstance(event, SampleFinished):
            samples[event.index].finish = event
        else:
            usage = event
    return samples, usage


async def collect_unless_gone(
    request: Request, generation: GenerationStream, num_samples: int
) -> tuple[list[CollectedSample], Usage]:
    """The whole result; if the client leaves first, the generation is aborted (ClientClosedError)."""
    try:
        return await unless_client_leaves(request.receive, lambda: collect(generation, num_samples))
    finally:
        await generation.aclose()


def stream_response(
    request: Request, stats: RequestStats, generation: GenerationStream, events: AsyncIterator[bytes]
) -> EventStreamResponse:
    """An SSE response whose failures become OpenAI's in-band `{"error": {...}}` event."""
    rid = request_id(request)

    def error_event(exc: BaseException) -> bytes:
        return encode_event(describe(exc, rid).body())

    def on_outcome(outcome: StreamOutcome) -> None:
        stats.set_stream_outcome(outcome)

    return EventStreamResponse(
        events,
        request_id=rid,
        error_event=error_event,
        send_timeout_s=codec_state(request).stream_send_timeout_s,
        cleanup=generation.aclose,
        on_outcome=on_outcome,
    )
