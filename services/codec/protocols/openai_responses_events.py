"""OpenAI Responses wire objects: the response object (32 keys) and the streamed event lifecycle.

`ResponseDraft` holds one response's identity and the request fields it echoes, and builds each
version of its object: in progress (lifecycle events), final (completed or incomplete) and failed.
Every version carries all 32 keys of the Open Responses schema, null where unset. `Lifecycle` owns
the streaming state (the next `sequence_number`, the text sent so far) and encodes each event with
`event:` equal to the data's `type`. The sequence is documented in openai_responses.py.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.codec.errors import WireError
from services.codec.generation import SampleFinished, Usage
from services.codec.protocols.schemas.responses import ResponsesRequest
from services.codec.protocols.sse import DONE, encode_event
from services.common.outputs import FinishReason

RESPONSE_ID_PREFIX = "resp_"
MESSAGE_ID_PREFIX = "msg_"


@dataclass(frozen=True)
class ResponseDraft:
    """One response's identity and the request fields it echoes; builds every version of its object."""

    response_id: str
    message_id: str
    created_at: int
    model: str
    request: ResponsesRequest

    @classmethod
    def new(cls, request: ResponsesRequest, model: str) -> ResponseDraft:
        response_id = f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"
        return cls(response_id, f"{MESSAGE_ID_PREFIX}{uuid.uuid4().hex}", int(time.time()), model, request)

    def message(self, status: str, text: str | None) -> dict[str, Any]:
        """The output message item; `text` None means no content part yet."""
        content = [] if text is None else [text_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def final(self, text: str, finish: SampleFinished | None, usage: Usage) -> dict[str, Any]:
        is_cut = finish is not None and finish.reason == FinishReason.LENGTH
        status = "incomplete" if is_cut else "completed"
        incomplete = {"reason": "max_output_tokens"} if is_cut else None
        output = [self.message(status, text)]
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
            "reasoning": None,
            "text": self.request.text_body(),
            "tools": [],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "truncation": "disabled",
            "service_tier": "default",
            "metadata": request.metadata or {},
            "user": request.user,
            "safety_identifier": request.safety_identifier,
            "prompt_cache_key": request.prompt_cache_key,
        }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
    }


@dataclass
class Lifecycle:
    """The streaming state of one response: the next sequence number and the text sent so far."""

    draft: ResponseDraft
    sequence_number: int = 0
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return encode_event(payload, event=kind)

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.draft.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[bytes]:
        draft = self.draft
        return [
            self.event("response.created", response=draft.body("in_progress", [])),
            self.event("response.in_progress", response=draft.body("in_progress", [])),
            self.event("response.output_item.added", output_index=0, item=draft.message("in_progress", None)),
            self.event("response.content_part.added", **self._place(), part=text_part("")),
        ]

    def delta(self, text: str) -> bytes:
        self.text_parts.append(text)
        return self.event("response.output_text.delta", **self._place(), delta=text, logprobs=[])

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        item = final["output"][0]
        return [
            self.event("response.output_text.done", **self._place(), text=self.text, logprobs=[]),
            self.event("response.content_part.done", **self._place(), part=text_part(self.text)),
            self.event("response.output_item.done", output_index=0, item=item),
            self.event(f"response.{final['status']}", response=final),
            DONE,
        ]

    def failed(self, error: WireError) -> bytes:
        """`error`, then `response.failed` with the text so far, then [DONE]: one write."""
        code = error.code or error.type
        failed = self.draft.body(
            "failed",
            [self.draft.message("incomplete", self.text)],
            error={"code": "server_error", "message": error.message},
        )
        return b"".join(
            [
                self.event("error", code=code, message=error.message, param=error.param),
                self.event("response.failed", response=failed),
                DONE,
            ]
        )
