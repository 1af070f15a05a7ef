"""OpenAI Chat Completions: `POST /v1/chat/completions`, non-streamed and streamed.

Stream sequence (no `event:` lines), every chunk with the same id/created/model/system_fingerprint:

    one chunk with every choice's `{"role": "assistant", "content": ""}` delta (indices 0..n-1, dense)
    content chunks, one choice each, with `logprobs: {"content": [...]}` when asked
    per choice, a chunk with an empty delta and its finish_reason
    with stream_options.include_usage: a chunk with `choices: []` and usage
    data: [DONE]
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.generation import SampleFinished, TextDelta, Usage
from services.codec.protocols.cache_retention import check_retention, retention_breakpoints
from services.codec.protocols.common import (
    Envelope,
    admit_and_start,
    open_route,
    stream_response,
    usage_body,
)
from services.codec.protocols.output import (
    AssistantEvent,
    CollectedOutput,
    Constrained,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallStarted,
    assistant_events,
    collect_output_unless_gone,
    is_tool_finish,
    prepare,
)
from services.codec.protocols.schemas.openai import ChatCompletionRequest
from services.codec.protocols.service_tier import served_tier
from services.codec.protocols.sse import DONE, encode_event
from services.codec.session import SESSION_HEADER, SessionSource, session_key
from services.common.outputs import TokenLogprob

PROTOCOL = "chat.completions"
ID_PREFIX = "chatcmpl"

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state, stats, body = await open_route(request, ChatCompletionRequest, PROTOCOL)
    check_retention(body.prompt_cache_retention, tenant_of(request))
    messages = body.template_messages()
    prompt_ids, plan = await prepare(
        state, messages, tools=body.toolset(), thinking=body.thinking(), constraint=body.constraint()
    )
    generation = await admit_and_start(
        request,
        state,
        stats,
        Constrained(body, plan.constraint),
        prompt_ids,
        max_tokens=body.requested_max_tokens,
        logprobs=body.num_top_logprobs,
        prompt_param="messages",
        session_key=session_key(
            header=request.headers.get(SESSION_HEADER),
            client_key=(SessionSource.PROMPT_CACHE_KEY, body.prompt_cache_key),
            model=state.identity.model_name,
            messages=messages,
            tenant=tenant_of(request).tenant_id,
        ),
        cache_breakpoints=retention_breakpoints(body.prompt_cache_retention, len(prompt_ids)),
        plan=plan,
        service_tier=body.service_tier,
    )
    object_name = "chat.completion.chunk" if body.is_stream else "chat.completion"
    envelope = Envelope.new(ID_PREFIX, object_name, state, served_tier(stats))
    num_samples = body.n or 1
    if body.is_stream:
        events = _chunks(assistant_events(generation, plan), envelope, num_samples, body.include_usage)
        return stream_response(request, stats, generation, events)
    samples, usage = await collect_output_unless_gone(request, generation, plan, num_samples)
    return JSONResponse(_completion_body(envelope, samples, usage, body.logprobs is True))


def _completion_body(
    envelope: Envelope, samples: list[CollectedOutput], usage: Usage, with_logprobs: bool
) -> dict[str, Any]:
    choices = [
        {
            "index": index,
            "message": _message(sample),
            "logprobs": _logprobs(sample.logprobs) if with_logprobs else None,
            "finish_reason": _finish_reason(sample.finish) or "stop",
        }
        for index, sample in enumerate(samples)
    ]
    return envelope.wrap(choices, usage=usage_body(usage))


def _message(sample: CollectedOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": sample.text, "refusal": None}
    if sample.calls:
        message["content"] = sample.text or None
        message["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in sample.calls
        ]
    if sample.reasoning_parts:
        message["reasoning_content"] = sample.reasoning
    return message


def _finish_reason(finish: SampleFinished | None) -> str | None:
    if finish is None:
        return None
    return "tool_calls" if is_tool_finish(finish) else finish.reason.value


async def _chunks(
    events: AsyncIterator[AssistantEvent], envelope: Envelope, num_samples: int, include_usage: bool
) -> AsyncIterator[bytes]:
    roles = [_choice(index, {"role": "assistant", "content": ""}) for index in range(num_samples)]
    yield encode_event(envelope.wrap(roles))
    async for event in events:
        if isinstance(event, TextDelta):
            logprobs = _logprobs(event.logprobs) if event.logprobs else None
            yield encode_event(envelope.wrap([_choice(event.index, {"content": event.text}, logprobs)]))
        elif isinstance(event, ReasoningDelta):
            yield encode_event(envelope.wrap([_choice(event.index, {"reasoning_content": event.text})]))
        elif isinstance(event, ToolCallStarted):
            call = {
                "index": event.call_index,
                "id": event.call_id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            yield encode_event(envelope.wrap([_choice(event.index, {"tool_calls": [call]})]))
        elif isinstance(event, ToolCallDelta):
            call = {"index": event.call_index, "function": {"arguments": event.fragment}}
            yield encode_event(envelope.wrap([_choice(event.index, {"tool_calls": [call]})]))
        elif isinstance(event, SampleFinished):
            yield encode_event(envelope.wrap([_choice(event.index, {}, None, event)]))
        elif isinstance(event, Usage) and include_usage:
            yield encode_event(envelope.wrap([], usage=usage_body(event)))
    yield DONE


def _choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish: SampleFinished | None = None,
) -> dict[str, Any]:
    reason = _finish_reason(finish)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _logprobs(logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {"content": [_token_logprob(item) for item in logprobs], "refusal": None}


def _token_logprob(item: TokenLogprob) -> dict[str, Any]:
    return {
        "token": item.token,
        "logprob": item.logprob,
        "bytes": list(item.token.encode("utf-8")),
        "top_logprobs": [
            {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            for text, (_, logprob) in zip(item.top_tokens, item.top, strict=True)
        ],
    }
