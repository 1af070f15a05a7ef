"""What the HTTP protocols share: passing the admission gate, the response envelope, usage, collecting a
non-streamed result, and streaming with OpenAI's in-band error event. `admit_and_start` serves every
HTTP protocol (Anthropic's Messages too) through the gate (services/codec/admission/gate.py), which the
public gRPC API passes too; refusals propagate to the registered error handler (errors.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from services.codec.admission.gate import SamplingSource
from services.codec.admission.tenancy import tenant_of
from services.codec.backend import results
from services.codec.backend.protocol import BackendUnavailableError
from services.codec.errors import WireError, describe
from services.codec.generation import (
    GenerationStream,
    SampleFinished,
    TextDelta,
    Usage,
)
from services.codec.metrics import RequestStats
from services.codec.protocols.disconnect import run_unless_gone, unless_client_leaves
from services.codec.protocols.output import OutputPlan
from services.codec.protocols.request_body import read_request
from services.codec.protocols.result_key import result_key_if_asked
from services.codec.protocols.service_tier import HEADER as PRIORITY_HEADER
from services.codec.protocols.service_tier import resolve_class
from services.codec.protocols.sse import EventStreamResponse, encode_event
from services.codec.state import CodecState, backend_request_id, codec_state, request_id, request_stats
from services.common import priority
from services.common.engine_input import CacheBreakpoint
from services.common.outputs import TokenLogprob


class RouteBody(Protocol):
    """A generation route's request schema: the model it names, and the fields it cannot honour."""

    @property
    def model(self) -> str | None: ...

    def check_supported(self) -> None: ...


BodyT = TypeVar("BodyT", bound=RouteBody)
PLAIN = OutputPlan()  # text read as it comes: no tools, no reasoning, no constraint
T = TypeVar("T")


async def open_route(
    request: Request, schema: type[BodyT], protocol: str
) -> tuple[CodecState, RequestStats, BodyT]:
    """A generation route's opening: its state and stats (counted under `protocol`), the request charged
    to the requests-per-minute quotas (429), the body parsed into `schema` (a 400 naming the first bad
    field), the model checked (404), unsupported fields refused."""
    state = codec_state(request)
    stats = request_stats(request)
    stats.protocol = protocol
    request.state.request_charge = await state.gate.charge_request(tenant_of(request).tenant_id)
    body = await read_request(request, schema)  # type: ignore[type-var]  # a pydantic schema
    state.check_model(body.model)
    body.check_supported()
    return state, stats, body


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
    cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
    plan: OutputPlan = PLAIN,
    decoder_prompt_ids: list[int] | None = None,
    service_tier: str | None = None,
) -> GenerationStream:
    """The gate's context rules and sampling validation, quotas, a slot, then the backend (or the
    exact-result cache, for a request that asks: `plan` is how its output is read, part of the key).
    The priority class comes from `service_tier` (OpenAI's routes) and the x-kvrelay-priority header.
    Every refusal happens before any byte and reaches the client through the registered error handler."""
    tenant = tenant_of(request)
    stats.priority_class = resolve_class(service_tier, request.headers.get(PRIORITY_HEADER), tenant)
    try:
        generation_request = await state.gate.admit(
            stats,
            fields,
            prompt_token_ids,
            request_id=backend_request_id(request),
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_param=prompt_param,
            timeout_s=state.request_timeout_s,
            cache_salt=tenant.cache_salt,
            session_key=session_key,
            cache_breakpoints=cache_breakpoints,
            decoder_prompt_ids=decoder_prompt_ids,
            priority=priority.BY_NAME[stats.priority_class],
        )
    except BackendUnavailableError:  # the server's failure, not the request's: its entry charge comes back
        await state.gate.quotas.refund(request.state.request_charge)
        raise
    asked = request.headers.get(results.REQUEST_HEADER, "")
    key = (
        await result_key_if_asked(asked, state, stats, tenant.tenant_id, generation_request, plan)
        if asked
        else None
    )
    # A client that leaves while queued, or while waiting for its first token, is dropped there and then.
    return await unless_client_leaves(
        request.receive,
        lambda: state.gate.start(
            tenant.tenant_id,
            generation_request,
            stats,
            request_charge=request.state.request_charge,
            result_key=key,
        ),
    )


@dataclass(frozen=True)
class Envelope:
    """The fields every response object and chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    service_tier: str | None = None  # Chat Completions: the tier that served the request

    @classmethod
    def new(
        cls, prefix: str, object_name: str, state: CodecState, service_tier: str | None = None
    ) -> Envelope:
        identity = state.identity
        return cls(
            f"{prefix}-{uuid.uuid4().hex}",
            object_name,
            int(time.time()),
            identity.model_name,
            state.system_fingerprint,
            service_tier,
        )

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            **({"service_tier": self.service_tier} if self.service_tier is not None else {}),
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
    return await run_unless_gone(request, generation, lambda: collect(generation, num_samples))


def stream_response(
    request: Request,
    stats: RequestStats,
    generation: GenerationStream,
    events: AsyncIterator[bytes],
    error_event: Callable[[WireError], bytes] | None = None,
) -> EventStreamResponse:
    """An SSE response whose failures become the protocol's in-band error event: `error_event` of the
    failure's wire error (errors.describe), OpenAI's `{"error": {...}}` by default."""
    rid = request_id(request)
    to_event = error_event or _openai_error_event
    return EventStreamResponse(
        events,
        request_id=rid,
        error_event=lambda exc: to_event(describe(exc, rid)),
        send_timeout_s=codec_state(request).stream_send_timeout_s,
        cleanup=generation.aclose,
        on_outcome=stats.set_stream_outcome,
    )


def _openai_error_event(error: WireError) -> bytes:
    return encode_event(error.body())
