"""Anthropic Messages: `POST /v1/messages`, non-streamed and streamed, and `POST /v1/messages/count_tokens`.

The prompt is the chat template over `system`, the messages and the tools (protocols/output.prepare: the
tool-aware template when tools are offered; the request's `thinking` for a template with a thinking mode).
A final assistant message of text is a prefill: the rest is rendered with the generation prompt and the
prefill's text tokens are appended, so the reply continues it (and does not repeat it).

`thinking` on a model without a thinking mode (its template writes no `<think>`: SmolLM2, Gemma 3) is
accepted and ignored: the prompt is the same as without it and the reply holds no thinking block. We
chose this over Anthropic's own answer for a model that cannot think (a 400) because clients such as
coding assistants send `thinking` on every request; its rules (budget_tokens >= 1024 and below
max_tokens, no forced tool_choice while thinking) are still checked, so a request that passes here
passes on Anthropic's API too.

Content, in this order: a `thinking` block (`signature` empty: nothing is signed here) when the model
thought, the text block (kept when empty only if it is the sole block), then a `tool_use` block per
call, `{"type": "tool_use", "id": "toolu_<24 hex>", "name", "input": {...}}`, and `stop_reason`
`tool_use` when the reply ends in calls.

Stream sequence, each event with an `event:` line equal to its JSON `type`. A plain reply (no tools
offered, no thinking):

    message_start        the message with empty content, null stop_reason and the usage so far
    content_block_start  index 0, an empty text block
    ping
    content_block_delta  index 0, a text_delta per piece of text
    content_block_stop   index 0
    message_delta        stop_reason, stop_sequence, and the final usage (output_tokens cumulative)
    message_stop

With tools or thinking, blocks open as their content arrives, with indices 0, 1, ... in order, and one
is closed before the next opens (message_start and ping come first):

    thinking   content_block_start {"type": "thinking", "thinking": "", "signature": ""},
               thinking_delta*, a signature_delta (empty), content_block_stop
    text       content_block_start {"type": "text", "text": ""}, text_delta*, content_block_stop
    tool_use   content_block_start {"type": "tool_use", "id", "name", "input": {}},
               input_json_delta* (fragments of the input's JSON text), content_block_stop

A reply with no block at all (e.g. empty text) gets one empty text block, so content is never empty.

message_start waits for the generation's first event, so that its usage already splits the prompt
into cached and uncached tokens. A failure after the first byte is one `event: error` with
`{"type": "error", "error": {"type", "message"}}`, then the stream ends.

Usage: `cache_read_input_tokens` counts the prompt tokens served from the prefix cache and the tiers below
it, `cache_creation_input_tokens` those up to the last `cache_control` breakpoint that this request
computed and wrote (whole blocks; `cache_creation` splits them by ttl; protocols/cache_retention.py), and
`input_tokens` the rest, so the three add up to the prompt length, which is what count_tokens returns as
`input_tokens` for the same body (tools included).

Admission is the OpenAI routes' (`protocols/common.admit_and_start`, the gate): over quota is a 429
`rate_limit_error`, a full queue a 529 `overloaded_error`, both with Retry-After.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import ANTHROPIC_REQUEST_ID_HEADER, WireError
from services.codec.generation import SampleFinished, TextDelta, Usage
from services.codec.metrics import RequestStats
from services.codec.protocols.cache_retention import anthropic_breakpoints, creation_by_ttl
from services.codec.protocols.common import admit_and_start, open_route, stream_response
from services.codec.protocols.output import (
    AssistantEvent,
    CollectedOutput,
    Constrained,
    OutputPlan,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    assistant_events,
    collect_output_unless_gone,
    is_tool_finish,
    prepare,
)
from services.codec.protocols.request_body import read_request
from services.codec.protocols.schemas.anthropic import CountTokensRequest, MessagesRequest, PromptFields
from services.codec.protocols.sse import encode_event
from services.codec.session import SESSION_HEADER, SessionSource, session_key
from services.codec.state import CodecState, codec_state, request_id
from services.codec.text.tool_calls import JsonPlace, json_places, new_call_id
from services.common.engine_input import CacheBreakpoint
from services.common.outputs import FinishReason

PROTOCOL = "anthropic.messages"
ID_PREFIX = "msg_"
TOOL_USE_PREFIX = "toolu_"
PROMPT_PARAM = "messages"

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state, stats, body = await open_route(request, MessagesRequest, PROTOCOL)
    prompt_ids, plan = await _prepare_prompt(state, body)
    breakpoints = await anthropic_breakpoints(state, body, prompt_ids)
    generation = await admit_and_start(
        request,
        state,
        stats,
        Constrained(body, plan.constraint),
        prompt_ids,
        max_tokens=body.max_tokens,
        logprobs=None,
        prompt_param=PROMPT_PARAM,
        session_key=_session_key(request, state, body),
        cache_breakpoints=breakpoints,
        plan=plan,
    )
    head = _MessageHead(f"{ID_PREFIX}{uuid.uuid4().hex}", state.identity.model_name, breakpoints)
    headers = {ANTHROPIC_REQUEST_ID_HEADER: request_id(request)}
    if body.is_stream:
        events = _events(assistant_events(generation, plan), head, stats, plan)
        response = stream_response(request, stats, generation, events, _error_event)
        response.headers.update(headers)
        return response
    samples, usage = await collect_output_unless_gone(request, generation, plan, 1)
    sample = samples[0]
    return JSONResponse(head.body(_content(sample), sample.finish, head.usage(usage)), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    state = codec_state(request)
    await state.gate.charge_request(tenant_of(request).tenant_id)
    body = await read_request(request, CountTokensRequest)
    state.check_model(body.model)
    body.check_supported()
    prompt_ids, _ = await _prepare_prompt(state, body)
    return JSONResponse(
        {"input_tokens": len(prompt_ids)}, headers={ANTHROPIC_REQUEST_ID_HEADER: request_id(request)}
    )


async def _prepare_prompt(state: CodecState, body: PromptFields) -> tuple[list[int], OutputPlan]:
    """The template over system, history and tools, then the prefill's text tokens if there is one;
    and how to read the output."""
    prompt_ids, plan = await prepare(
        state,
        body.template_messages(),
        tools=body.toolset(),
        thinking=body.thinking_wish(),
        constraint=body.constraint(),
    )
    prefill = body.prefill_text()
    if prefill:
        prompt_ids += await state.encoder.text(prefill, add_special_tokens=False, param=PROMPT_PARAM)
    return prompt_ids, plan


def _session_key(request: Request, state: CodecState, body: MessagesRequest) -> str:
    """x-session-id, else metadata.user_id, else the first user message (`system` never counts)."""
    user_id = body.metadata.user_id if body.metadata is not None else None
    return session_key(
        header=request.headers.get(SESSION_HEADER),
        client_key=(SessionSource.ANTHROPIC_USER_ID, user_id),
        model=state.identity.model_name,
        messages=body.template_messages(),
        tenant=tenant_of(request).tenant_id,
    )


@dataclass(frozen=True)
class _MessageHead:
    """What the response message and message_start repeat."""

    id: str
    model: str
    breakpoints: tuple[CacheBreakpoint, ...] = ()  # the request's cache_control, for the usage

    def usage(self, counts: Usage | RequestStats, *, by_ttl: bool = True) -> dict[str, Any]:
        """The usage so far (`counts`): `input_tokens`, `cache_read_input_tokens` and
        `cache_creation_input_tokens` add up to the prompt. `by_ttl`: with `cache_creation`, the split
        of the creation tokens by ttl (the message's usage has it; message_delta's does not)."""
        creation = creation_by_ttl(self.breakpoints, counts.num_cache_written_tokens)
        num_created = sum(creation.values())
        out: dict[str, Any] = {
            "input_tokens": counts.num_prompt_tokens - counts.num_cached_tokens - num_created,
            "output_tokens": counts.num_completion_tokens,
            "cache_creation_input_tokens": num_created,
            "cache_read_input_tokens": counts.num_cached_tokens,
        }
        if by_ttl:
            out["cache_creation"] = creation
        return out

    def body(
        self, content: list[dict[str, Any]], finish: SampleFinished | None, usage: dict[str, Any]
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
    """(stop_reason, stop_sequence); both None while the message is still being generated. A reply that
    ends in complete calls is `tool_use`, even when a stop sequence ended it: the calls want results."""
    if finish is None:
        return None, None
    if is_tool_finish(finish):
        return "tool_use", None
    if finish.stop is not None:
        return "stop_sequence", finish.stop
    if finish.reason is FinishReason.LENGTH:
        return "max_tokens", None  # admission keeps prompt + max_tokens within the context
    return "end_turn", None


def _content(sample: CollectedOutput) -> list[dict[str, Any]]:
    """The non-streamed content blocks: thinking, text, then one tool_use per call."""
    content: list[dict[str, Any]] = []
    if sample.reasoning_parts:
        content.append({"type": "thinking", "thinking": sample.reasoning, "signature": ""})
    if sample.text or not (content or sample.calls):
        content.append({"type": "text", "text": sample.text})
    content += [
        {
            "type": "tool_use",
            "id": new_call_id(TOOL_USE_PREFIX),
            "name": call.name,
            "input": tool_input(call.arguments),
        }
        for call in sample.calls
    ]
    return content


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object `input` must be. Arguments cut short (max_tokens inside a forced
    call) keep their longest prefix that closes into an object, as the stream's partial JSON showed."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = _longest_closed_prefix(arguments)
    return value if isinstance(value, dict) else {}


def _longest_closed_prefix(text: str) -> Any:
    """The value of the longest prefix of `text` (cut outside strings, after a complete value or an
    opening bracket) that parses once its open brackets are closed; None if none does."""
    cuts: list[tuple[int, str]] = []  # (end of prefix, the closers it needs)
    stack: list[str] = []
    for index, char, place in json_places(text):
        if place is JsonPlace.INSIDE or (place is JsonPlace.OUTSIDE and char == '"'):
            continue
        if char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]" and stack:
            stack.pop()
        elif place is not JsonPlace.CLOSE and not char.isalnum():
            continue
        cuts.append((index + 1, "".join(reversed(stack))))
    for end, closers in reversed(cuts):
        try:
            return json.loads(text[:end] + closers)
        except ValueError:
            continue
    return None


def _event(name: str, **fields: Any) -> bytes:
    return encode_event({"type": name, **fields}, event=name)


@dataclass
class _Blocks:
    """The stream's content blocks: at most one open, each closed before the next opens."""

    count: int = 0
    open_kind: str | None = None  # "text", "thinking" or "tool_use"
    open_call: int | None = None  # the call index of an open tool_use block
    tool_ids: dict[int, str] = field(default_factory=dict)

    @property
    def index(self) -> int:
        return self.count - 1

    def opened_text(self) -> None:
        """A text block at index 0 is already open (a plain reply's eager opening)."""
        self.count, self.open_kind = 1, "text"

    def text(self, text: str) -> list[bytes]:
        out = self._ensure("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*out, _event("content_block_delta", index=self.index, delta=delta)]

    def thinking(self, text: str) -> list[bytes]:
        out = self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "thinking_delta", "thinking": text}
        return [*out, _event("content_block_delta", index=self.index, delta=delta)]

    def start_tool(self, call_index: int, name: str) -> list[bytes]:
        out = self.close()
        tool_id = self.tool_ids[call_index] = new_call_id(TOOL_USE_PREFIX)
        block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
        self.count, self.open_kind, self.open_call = self.count + 1, "tool_use", call_index
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def tool_delta(self, call_index: int, fragment: str) -> list[bytes]:
        if self.open_kind != "tool_use" or self.open_call != call_index or not fragment:
            return []
        delta = {"type": "input_json_delta", "partial_json": fragment}
        return [_event("content_block_delta", index=self.index, delta=delta)]

    def end_tool(self, call_index: int) -> list[bytes]:
        return self.close() if self.open_kind == "tool_use" and self.open_call == call_index else []

    def close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out.append(_event("content_block_delta", index=self.index, delta=delta))
        out.append(_event("content_block_stop", index=self.index))
        self.open_kind = self.open_call = None
        return out

    def finish(self) -> list[bytes]:
        """Closes the open block; a reply with none gets an empty text block."""
        if self.count == 0:
            return [*self._ensure("text", {"type": "text", "text": ""}), *self.close()]
        return self.close()

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open_kind == kind:
            return []
        out = self.close()
        self.count, self.open_kind = self.count + 1, kind
        return [*out, _event("content_block_start", index=self.index, content_block=block)]


async def _events(
    events: AsyncIterator[AssistantEvent], head: _MessageHead, stats: RequestStats, plan: OutputPlan
) -> AsyncIterator[bytes]:
    finish: SampleFinished | None = None
    blocks = _Blocks()
    is_open = False
    async for event in events:
        if not is_open:  # the first event: the stats now hold the cached-token count
            is_open = True
            for opening in _opening_events(head, stats, with_text_block=plan.is_plain):
                yield opening
            if plan.is_plain:
                blocks.opened_text()
        out: list[bytes] = []
        if isinstance(event, TextDelta):
            out = blocks.text(event.text) if event.text else []
        elif isinstance(event, ReasoningDelta):
            out = blocks.thinking(event.text) if event.text else []
        elif isinstance(event, ToolCallStarted):
            out = blocks.start_tool(event.call_index, event.name)
        elif isinstance(event, ToolCallDelta):
            out = blocks.tool_delta(event.call_index, event.fragment)
        elif isinstance(event, ToolCallDone):
            out = blocks.end_tool(event.call_index)
        elif isinstance(event, SampleFinished):
            finish = event
        elif isinstance(event, Usage):  # the last event
            stop_reason, stop_sequence = stop_fields(finish)
            out = blocks.finish()
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            out.append(_event("message_delta", delta=delta, usage=head.usage(event, by_ttl=False)))
            out.append(_event("message_stop"))
        for chunk in out:
            yield chunk


def _opening_events(head: _MessageHead, stats: RequestStats, *, with_text_block: bool) -> list[bytes]:
    opening = [_event("message_start", message=head.body([], None, head.usage(stats)))]
    if with_text_block:
        opening.append(_event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
    return [*opening, _event("ping")]


def _error_event(error: WireError) -> bytes:
    """Anthropic's in-band `event: error`."""
    return encode_event(error.anthropic_body(), event="error")
