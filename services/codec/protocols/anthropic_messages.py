"""Anthropic Messages: `POST /v1/messages`, non-streamed and streamed, and `POST /v1/messages/count_tokens`.

The prompt is the chat template over `system` and the messages. A final assistant message is a
prefill: the rest is rendered with the generation prompt and the prefill's text tokens are appended,
so the reply continues it (and does not repeat it).

Stream sequence, each event with an `event:` line equal to its JSON `type`:

    message_start        the message with empty content, null stop_reason and the usage so far
    content_block_start  index 0, an empty text block
    ping
    content_block_delta  index 0, a text_delta per piece of text
    content_block_stop   index 0
    message_delta        stop_reason, stop_sequence, and the final usage (output_tokens cumulative)
    message_stop

message_start waits for the generation's first event, so that its usage already splits the prompt
into cached and uncached tokens. A failure after the first byte is one `event: error` with
`{"type": "error", "error": {"type", "message"}}`, then the stream ends.

Usage: `input_tokens` counts the uncached prompt tokens, `cache_read_input_tokens` the cached ones
and `cache_creation_input_tokens` is 0, so the three add up to the prompt length, which is what
count_tokens returns as `input_tokens` for the same body.

Admission is the OpenAI routes' (`protocols/common.admit_and_start`, the gate): over quota is a 429
`rate_limit_error`, a full queue a 529 `overloaded_error`, both with Retry-After.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import ANTHROPIC_REQUEST_ID_HEADER, WireError
from services.codec.generation import GenerationStream, SampleFinished, TextDelta, Usage
from services.codec.metrics import RequestStats
from services.codec.protocols.common import admit_and_start, collect_unless_gone, open_route, stream_response
from services.codec.protocols.request_body import read_request
from services.codec.protocols.schemas.anthropic import CountTokensRequest, MessagesRequest, PromptFields
from services.codec.protocols.sse import encode_event
from services.codec.session import SESSION_HEADER, SessionSource, session_key
from services.codec.state import CodecState, codec_state, request_id
from services.common.outputs import FinishReason

PROTOCOL = "anthropic.messages"
ID_PREFIX = "msg_"
PROMPT_PARAM = "messages"

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state, stats, body = await open_route(request, MessagesRequest, PROTOCOL)
    generation = await admit_and_start(
        request,
        state,
        stats,
        body,
        await _encode_prompt(state, body),
        max_tokens=body.max_tokens,
        logprobs=None,
        prompt_param=PROMPT_PARAM,
        session_key=_session_key(request, state, body),
    )
    head = _MessageHead(f"{ID_PREFIX}{uuid.uuid4().hex}", state.identity.model_name)
    headers = {ANTHROPIC_REQUEST_ID_HEADER: request_id(request)}
    if body.is_stream:
        events = _events(generation, head, stats)
        response = stream_response(request, stats, generation, events, _error_event)
        response.headers.update(headers)
        return response
    samples, usage = await collect_unless_gone(request, generation, 1)
    sample = samples[0]
    content = [{"type": "text", "text": sample.text}]
    return JSONResponse(head.body(content, sample.finish, usage_body(usage)), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state = codec_state(request)
    await state.gate.charge_request(tenant_of(request).tenant_id)
    body = await read_request(request, CountTokensRequest)
    state.check_model(body.model)
    body.check_supported()
    num_tokens = len(await _encode_prompt(state, body))
    return JSONResponse(
        {"input_tokens": num_tokens}, headers={ANTHROPIC_REQUEST_ID_HEADER: request_id(request)}
    )


async def _encode_prompt(state: CodecState, body: PromptFields) -> list[int]:
    """The template over system and history, then the prefill's text tokens if there is one."""
    token_ids = await state.encoder.chat(state.require_chat_template(), body.template_messages())
    prefill = body.prefill_text()
    if prefill:
        token_ids += await state.encoder.text(prefill, add_special_tokens=False, param="messages")
    return token_ids


def _session_key(request: Request, state: CodecState, body: MessagesRequest) -> str:
    """x-session-id, else metadata.user_id, else the first user message (`system` never counts)."""
    user_id = body.metadata.user_id if body.metadata is not None else None
    return session_key(
        header=request.headers.get(SESSION_HEADER),
        client_key=(SessionSource.ANTHROPIC_USER_ID, user_id),
        model=state.identity.model_name,
        messages=body.template_messages(),
    )


@dataclass(frozen=True)
class _MessageHead:
    """What the response message and message_start repeat."""

    id: str
    model: str

    def body(
        self, content: list[dict[str, Any]], finish: SampleFinished | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        stop_reason, stop_sequence = stop_fields(finish)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }


def stop_fields(finish: SampleFinished | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence); both None while the message is still being generated."""
    if finish is None:
        return None, None
    if finish.stop is not None:
        return "stop_sequence", finish.stop
    if finish.reason is FinishReason.LENGTH:
        return "max_tokens", None  # admission keeps prompt + max_tokens within the context
    return "end_turn", None


def usage_body(usage: Usage) -> dict[str, int]:
    return _usage(usage.num_prompt_tokens, usage.num_cached_tokens, usage.num_completion_tokens)


def _usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": num_prompt_tokens - num_cached_tokens,
        "output_tokens": num_output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": num_cached_tokens,
    }


def _event(name: str, **fields: Any) -> bytes:
    return encode_event({"type": name, **fields}, event=name)


async def _events(
    generation: GenerationStream, head: _MessageHead, stats: RequestStats
) -> AsyncIterator[bytes]:
    finish: SampleFinished | None = None
    is_open = False
    async for event in generation:
        if not is_open:  # the first event: the stats now hold the cached-token count
            is_open = True
            for opening in _opening_events(head, stats):
                yield opening
        if isinstance(event, TextDelta) and event.text:
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": event.text})
        elif isinstance(event, SampleFinished):
            finish = event
        elif isinstance(event, Usage):  # the last event
            stop_reason, stop_sequence = stop_fields(finish)
            yield _event("content_block_stop", index=0)
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            yield _event("message_delta", delta=delta, usage=usage_body(event))
            yield _event("message_stop")


def _opening_events(head: _MessageHead, stats: RequestStats) -> list[bytes]:
    usage = _usage(stats.num_prompt_tokens, stats.num_cached_tokens, stats.num_completion_tokens)
    return [
        _event("message_start", message=head.body([], None, usage)),
        _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        _event("ping"),
    ]


def _error_event(error: WireError) -> bytes:
    """Anthropic's in-band `event: error`."""
    return encode_event(error.anthropic_body(), event="error")
