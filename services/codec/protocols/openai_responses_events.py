"""OpenAI Responses wire objects: the response object (32 keys), its output items and the streamed event
lifecycle.

`ResponseDraft` holds one response's identity and the request fields it echoes, and builds each
version of its object: in progress (lifecycle events), final (completed or incomplete) and failed.
Every version carries all 32 keys of the Open Responses schema, null where unset. `OutputItems` turns
the assistant's events (protocols/output.py) into output items, in the order they appear, and says
which stream events each step makes; the non-streamed route builds its output with it too, so both
agree. `Lifecycle` owns the streaming state (the next `sequence_number`) and encodes each event with
`event:` equal to the data's `type`. The sequence is documented in openai_responses.py.

Items:

    reasoning      {"type": "reasoning", "id": "rs_…", "summary": [], "content": [reasoning_text]}
    message        {"type": "message", "id": "msg_…", "status", "role": "assistant", "content": [output_text]}
    function_call  {"type": "function_call", "id": "fc_…", "call_id", "name", "arguments", "status"}

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

    @classmethod
    def new(cls, request: ResponsesRequest, model: str, *, thinks: bool = False) -> ResponseDraft:
        """`thinks`: the model has a thinking mode, so `reasoning` is honoured (and echoed)."""
        reasoning = request.reasoning_body() if thinks else None
        return cls(
            new_id(RESPONSE_ID_PREFIX),
            new_id(MESSAGE_ID_PREFIX),
            int(time.time()),
            model,
            request,
            reasoning,
        )

    def message(self, status: str, text: str | None, message_id: str | None = None) -> dict[str, Any]:
        """An output message item; `text` None means no content part yet."""
        content = [] if text is None else [text_part(text)]
        return {
            "type": "message",
            "id": message_id or self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

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
            "background": False,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "reasoning": self.reasoning,
            "text": self.request.text_body(),
            "tools": request.tools_body(),
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "truncation": "disabled",
            "service_tier": "default",
            "metadata": request.metadata or {},
            "user": request.user,
            "safety_identifier": request.safety_identifier,
            "prompt_cache_key": request.prompt_cache_key,
        }


def is_cut(finish: SampleFinished | None) -> bool:
    return finish is not None and finish.reason == FinishReason.LENGTH


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.num_cached_tokens, "cache_write_tokens": 0},
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

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def body(self, draft: ResponseDraft, status: str, *, opening: bool = False) -> dict[str, Any]:
        if self.kind == "message":
            return draft.message(status, None if opening else self.text, self.item_id)
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
            out = self._close_open("completed")
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
        out += self._close_open("incomplete" if is_cut(finish) else "completed")
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
            out += self._close_open("completed")
            out += self._open_item("message")
        item = self._open
        assert item is not None
        item.parts.append(text)
        out.append(("response.output_text.delta", {**self._text_place(item), "delta": text, "logprobs": []}))
        return out

    def _reasoning(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._open is None or self._open.kind != "reasoning":
            out += self._close_open("completed")
            out += self._open_item("reasoning")
        item = self._open
        assert item is not None
        item.parts.append(text)
        out.append(("response.reasoning_text.delta", {**self._text_place(item), "delta": text}))
        return out

    def _open_item(self, kind: str, *, call_id: str = "", name: str = "") -> list[StreamEvent]:
        if kind == "message":
            # The first message keeps the draft's ID (what a text-only response always had).
            item_id = self._draft.message_id if self._messages == 0 else new_id(MESSAGE_ID_PREFIX)
            self._messages += 1
        else:
            item_id = new_id(FUNCTION_CALL_ID_PREFIX if kind == "function_call" else REASONING_ID_PREFIX)
        item = _Item(kind, item_id, len(self._items), call_id, name)
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
        return out

    def _close_open(self, status: str) -> list[StreamEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        out: list[StreamEvent] = []
        place = self._text_place(item)
        if item.kind == "message":
            out.append(("response.output_text.done", {**place, "text": item.text, "logprobs": []}))
            out.append(("response.content_part.done", {**place, "part": text_part(item.text)}))
        elif item.kind == "reasoning":
            out.append(("response.reasoning_text.done", {**place, "text": item.text}))
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
        code = error.code or error.type
        failed = self.draft.body(
            "failed", self.output.bodies(), error={"code": "server_error", "message": error.message}
        )
        return b"".join(
            [
                self.event("error", code=code, message=error.message, param=error.param),
                self.event("response.failed", response=failed),
                DONE,
            ]
        )
