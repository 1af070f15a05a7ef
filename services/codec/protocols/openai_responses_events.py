"""OpenAI Responses wire objects: the response object (32 keys), its output items and the streamed event
lifecycle.

`ResponseDraft` holds one response's identity and the request fields it echoes, and builds each
version of its object: in progress (lifecycle events), final (completed or incomplete) and failed.
Every version carries all 32 keys of the Open Responses schema, null where unset. `OutputItems` turns
the assistant's events (protocols/output.py) into output items, in the order they appear, and says
which stream events each step makes; the non-streamed route builds its output with it too, so both
agree. `Lifecycle` owns the streaming state (the next `sequence_number`) and encodes each event with
`event:` equal to the data's `type`. The sequence is documented in openai_responses.py.

Every object and event validates against the Open Responses schemas (vendored in
tests/fixtures/openresponses; tests/unit/test_responses_openresponses_schema.py checks each one).

Items:

    reasoning      {"type": "reasoning", "id": "rs_…", "summary": [], "content": [reasoning_text]}
    message        {"type": "message", "id": "msg_…", "status", "role": "assistant", "content": [output_text],
                    "phase"}
    function_call  {"type": "function_call", "id": "fc_…", "call_id", "name", "arguments", "status"}

An `output_text` part always carries `annotations` (none here) and `logprobs` (not offered: empty).

`phase` labels an assistant message as intermediate `commentary` or the `final_answer` (the specification
asks clients to resend it with the message when they continue a conversation; input messages may carry it).
A message is `commentary` when another item follows it in the same response (text before a function call:
"Let me check." then the call), and `final_answer` when it ends the output (a plain reply; the answer after
reasoning; the text of a response cut by max_output_tokens, still meant as the answer). Which it is shows
when the message ends, so a response that may call a tool (function tools offered, tool_choice not "none")
states `phase` from the message's `response.output_item.done` on, not on its `response.output_item.added`,
nor on a message still open when the response fails; one that cannot call has only final answers and states
it from the start.

Streamed content is backed by a content part, as the specification asks: a message's output_text and a
reasoning item's reasoning_text each open with `response.content_part.added` and close with
`response.content_part.done`. Reasoning text streams as `response.reasoning.delta` and
`response.reasoning.done`, the specification's events (OpenAI's API names them
`response.reasoning_text.*`, which the specification does not define; the openai SDK's strict parser
rejects the specification's names, its default parser passes them through).

The `error` event carries the specification's `error` payload (`type`, `code`, `message`, `param`) and,
beside it, the same `code`, `message` and `param` at the top level, OpenAI's shape, for clients written
against that. (The openai SDK raises `APIError` on any stream event with an `error` object, so its users
see a failed stream as that exception.)

An item ends when the next one starts (completed), or at the end of the output (incomplete when the
response is cut by max_output_tokens); a call ends when its arguments do (incomplete when they are not
JSON: cut mid-call). A plain reply (no tools, no thinking) opens its message before any text, as it
always did, so a text-only stream keeps its exact bytes; otherwise items open when their first piece
comes, and a response whose output has no item at all gets an empty message.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.codec.errors import WireError
from services.codec.generation import GenerationEvent, SampleFinished, TextDelta, Usage
from services.codec.protocols.output import (
    AssistantEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
)
from services.codec.protocols.schemas.responses import ResponsesRequest
from services.codec.protocols.sse import DONE, encode_event
from services.common.outputs import FinishReason

RESPONSE_ID_PREFIX = "resp_"
MESSAGE_ID_PREFIX = "msg_"
FUNCTION_CALL_ID_PREFIX = "fc_"
REASONING_ID_PREFIX = "rs_"

StreamEvent = tuple[str, dict[str, Any]]  # an event's type and its fields (without sequence_number)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseDraft:
    """One response's identity and the request fields it echoes; builds every version of its object.
    `reasoning`: the request's `reasoning` as echoed, when the model honours it (None otherwise)."""

    response_id: str
    message_id: str
    created_at: int
    model: str
    request: ResponsesRequest
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"  # the tier that serves it (protocols/service_tier.py)

    @classmethod
    def new(
        cls, request: ResponsesRequest, model: str, *, thinks: bool = False, service_tier: str = "default"
    ) -> ResponseDraft:
        """`thinks`: the model has a thinking mode, so `reasoning` is honoured (and echoed)."""
        reasoning = request.reasoning_body() if thinks else None
        return cls(
            new_id(RESPONSE_ID_PREFIX),
            new_id(MESSAGE_ID_PREFIX),
            int(time.time()),
            model,
            request,
            reasoning,
            service_tier,
        )

    def message(
        self, status: str, text: str | None, message_id: str | None = None, *, phase: str | None = None
    ) -> dict[str, Any]:
        """An output message item; `text` None means no content part yet; `phase` None: not known yet
        (left out, as the schema allows)."""
        content = [] if text is None else [text_part(text)]
        item: dict[str, Any] = {
            "type": "message",
            "id": message_id or self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }
        if phase is not None:
            item["phase"] = phase
        return item

    def final(
        self, output: list[dict[str, Any]], finish: SampleFinished | None, usage: Usage
    ) -> dict[str, Any]:
        status = "incomplete" if is_cut(finish) else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return self.body(
            status, output, usage=usage_body(usage), incomplete=incomplete, completed_at=int(time.time())
        )

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, str] | None = None,
        error: dict[str, str] | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": completed_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            **self.settings(),
            "usage": usage,
        }

    def settings(self) -> dict[str, Any]:
        """The 23 keys that say how the response was made: the request's values or the served ones."""
        request = self.request
        return {
            "model": self.model,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "previous_response_id": request.previous_response_id,
            "store": request.is_stored,
            "background": request.background is True,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "reasoning": self.reasoning,
            "text": text_echo(self.request.text_body()),
            "tools": request.tools_body(),
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "truncation": "disabled",
            "service_tier": self.service_tier,
            "metadata": request.metadata or {},
            "user": request.user,
            "safety_identifier": request.safety_identifier,
            "prompt_cache_key": request.prompt_cache_key,
        }


def can_call(request: ResponsesRequest) -> bool:
    """Whether the response may call a function (so a message's phase shows only when it ends)."""
    return bool(request.tools_body()) and request.tool_choice != "none"


def text_echo(text: dict[str, Any]) -> dict[str, Any]:
    """The response's `text` with a json_schema format's `description` and `strict` always present (the
    schema requires both; null and false when the request left them out)."""
    text_format = text.get("format")
    if not isinstance(text_format, dict) or text_format.get("type") != "json_schema":
        return text
    filled = {**text_format, "description": text_format.get("description")}
    filled["strict"] = bool(text_format.get("strict"))
    return {**text, "format": filled}


def is_cut(finish: SampleFinished | None) -> bool:
    return finish is not None and finish.reason == FinishReason.LENGTH


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def error_payload(error: WireError) -> dict[str, Any]:
    """The `error` event's payload (the schema's ErrorPayload: all four keys, code and param nullable)."""
    return {
        "type": error.type,
        "code": error.code or error.type,
        "message": error.message,
        "param": error.param,
    }


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.num_cached_tokens,
            "cache_write_tokens": sum(usage.num_cache_written_tokens),  # with prompt_cache_retention "24h"
        },
        "output_tokens": usage.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
    }


@dataclass
class _Item:
    """One output item as it grows: its text (message), reasoning text or arguments in `parts`."""

    kind: str  # "message" | "reasoning" | "function_call"
    item_id: str
    output_index: int
    call_id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)
    status: str | None = None  # set when it ends
    phase: str | None = None  # a message's, once known (see the module docstring)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def body(self, draft: ResponseDraft, status: str, *, opening: bool = False) -> dict[str, Any]:
        if self.kind == "message":
            return draft.message(status, None if opening else self.text, self.item_id, phase=self.phase)
        if self.kind == "reasoning":
            content = [] if opening else [reasoning_part(self.text)]
            return {"type": "reasoning", "id": self.item_id, "summary": [], "content": content}
        return {
            "type": "function_call",
            "id": self.item_id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "" if opening else self.text,
            "status": status,
        }


class OutputItems:
    """One response's output items, built from the assistant's events of its one sample. Each step
    returns the stream events it makes (a non-streamed response ignores them)."""

    def __init__(self, draft: ResponseDraft, *, plain: bool) -> None:
        self._draft = draft
        self._plain = plain
        self._can_call = can_call(draft.request)
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._messages = 0

    @property
    def items(self) -> list[_Item]:
        return self._items

    def start(self) -> list[StreamEvent]:
        """A plain reply's message opens before its text comes (as a text-only stream always did)."""
        return self._open_item("message") if self._plain else []

    def add(self, event: AssistantEvent | GenerationEvent) -> list[StreamEvent]:
        if isinstance(event, TextDelta):
            return self._text(event.text) if event.text else []
        if isinstance(event, ReasoningDelta):
            return self._reasoning(event.text) if event.text else []
        if isinstance(event, ToolCallStarted):
            out = self._close_open("completed", followed=True)
            out += self._open_item("function_call", call_id=event.call_id, name=event.name)
            return out
        if isinstance(event, ToolCallDelta):
            item = self._open
            if item is None or item.kind != "function_call" or not event.fragment:
                return []
            item.parts.append(event.fragment)
            return [
                (
                    "response.function_call_arguments.delta",
                    {**self._item_place(item), "delta": event.fragment},
                )
            ]
        if isinstance(event, ToolCallDone):
            item = self._open
            if item is None or item.kind != "function_call":
                return []
            item.parts = [event.arguments]
            return self._close_open("completed" if _is_json(event.arguments) else "incomplete")
        return []

    def finish(self, finish: SampleFinished | None) -> list[StreamEvent]:
        """Ends the open item (incomplete when the response was cut); an output with no item at all gets
        an empty message."""
        out: list[StreamEvent] = []
        if not self._items:
            out += self._open_item("message")
        out += self._close_open("incomplete" if is_cut(finish) else "completed", followed=False)
        return out

    def bodies(self, *, open_status: str = "incomplete") -> list[dict[str, Any]]:
        """The items as the response object lists them; one still open has `open_status`."""
        return [item.body(self._draft, item.status or open_status) for item in self._items]

    def message_text(self) -> str:
        return "".join(item.text for item in self._items if item.kind == "message")

    def calls(self) -> list[_Item]:
        return [item for item in self._items if item.kind == "function_call"]

    # ---- steps ----

    def _text(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._open is None or self._open.kind != "message":
            out += self._close_open("completed", followed=True)
            out += self._open_item("message")
        item = self._open
        assert item is not None
        item.parts.append(text)
        out.append(("response.output_text.delta", {**self._text_place(item), "delta": text, "logprobs": []}))
        return out

    def _reasoning(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._open is None or self._open.kind != "reasoning":
            out += self._close_open("completed", followed=True)
            out += self._open_item("reasoning")
        item = self._open
        assert item is not None
        item.parts.append(text)
        out.append(("response.reasoning.delta", {**self._text_place(item), "delta": text}))
        return out

    def _open_item(self, kind: str, *, call_id: str = "", name: str = "") -> list[StreamEvent]:
        if kind == "message":
            # The first message keeps the draft's ID (what a text-only response always had).
            item_id = self._draft.message_id if self._messages == 0 else new_id(MESSAGE_ID_PREFIX)
            self._messages += 1
        else:
            item_id = new_id(FUNCTION_CALL_ID_PREFIX if kind == "function_call" else REASONING_ID_PREFIX)
        item = _Item(kind, item_id, len(self._items), call_id, name)
        if kind == "message" and not self._can_call:
            item.phase = "final_answer"  # no call can follow: every message is the answer
        self._items.append(item)
        self._open = item
        out: list[StreamEvent] = [
            (
                "response.output_item.added",
                {
                    "output_index": item.output_index,
                    "item": item.body(self._draft, "in_progress", opening=True),
                },
            )
        ]
        if kind == "message":
            out.append(("response.content_part.added", {**self._text_place(item), "part": text_part("")}))
        elif kind == "reasoning":
            out.append(
                ("response.content_part.added", {**self._text_place(item), "part": reasoning_part("")})
            )
        return out

    def _close_open(self, status: str, *, followed: bool = True) -> list[StreamEvent]:
        """Ends the open item with `status`; `followed`: another item opens after it (a message that
        ends the output is the final answer, one followed by more is commentary)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        out: list[StreamEvent] = []
        place = self._text_place(item)
        if item.kind == "message":
            item.phase = item.phase or ("commentary" if followed else "final_answer")
            out.append(("response.output_text.done", {**place, "text": item.text, "logprobs": []}))
            out.append(("response.content_part.done", {**place, "part": text_part(item.text)}))
        elif item.kind == "reasoning":
            out.append(("response.reasoning.done", {**place, "text": item.text}))
            out.append(("response.content_part.done", {**place, "part": reasoning_part(item.text)}))
        else:
            out.append(
                ("response.function_call_arguments.done", {**self._item_place(item), "arguments": item.text})
            )
        body = item.body(self._draft, status)
        out.append(("response.output_item.done", {"output_index": item.output_index, "item": body}))
        return out

    @staticmethod
    def _item_place(item: _Item) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.output_index}

    @staticmethod
    def _text_place(item: _Item) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class Lifecycle:
    """The streaming state of one response: the next sequence number and its output so far."""

    draft: ResponseDraft
    output: OutputItems
    sequence_number: int = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return encode_event(payload, event=kind)

    def _encoded(self, events: list[StreamEvent]) -> list[bytes]:
        return [self.event(kind, **fields) for kind, fields in events]

    def opening(self) -> list[bytes]:
        draft = self.draft
        return [
            self.event("response.created", response=draft.body("in_progress", [])),
            self.event("response.in_progress", response=draft.body("in_progress", [])),
            *self._encoded(self.output.start()),
        ]

    def add(self, event: AssistantEvent) -> list[bytes]:
        return self._encoded(self.output.add(event))

    def end_items(self, finish: SampleFinished | None) -> list[bytes]:
        """The events that end the output's open item (call before building the final object)."""
        return self._encoded(self.output.finish(finish))

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        return [self.event(f"response.{final['status']}", response=final), DONE]

    def failed(self, error: WireError) -> bytes:
        """`error`, then `response.failed` with the output so far, then [DONE]: one write."""
        payload = error_payload(error)
        failed = self.draft.body(
            "failed", self.output.bodies(), error={"code": "server_error", "message": error.message}
        )
        return b"".join(
            [
                self.event(
                    "error",
                    code=payload["code"],
                    message=error.message,
                    param=error.param,
                    error=payload,
                ),
                self.event("response.failed", response=failed),
                DONE,
            ]
        )
