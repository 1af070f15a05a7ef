"""`POST /v1/responses/compact` (Open Responses 2026-04-24): a conversation folded into one opaque item.

The conversation is what a response would see (`previous_response_id`'s, from the WebSocket
connection or the store, then `input`, with `instructions` first). The model itself writes the summary:
the conversation goes in as a transcript under SUMMARY_INSTRUCTIONS, greedy, at most
`responses.compaction_max_output_tokens` tokens, through the same admission gate as any request (its
tokens are charged to the tenant and reported in `usage`). The answer is the specification's
compaction resource whose `output` is the compacted window, one `compaction` item:

    {"id": "resp_…", "object": "response.compaction", "created_at", "usage",
     "output": [{"type": "compaction", "id": "cmp_…", "encrypted_content": "kvc1.…"}]}

The summary is sealed with AES-256-GCM for this tenant and model (compaction_keys.py), so a client can
neither read nor forge it, and another tenant or model cannot open it (a 400). Sent back as an input
item of `/v1/responses` (HTTP or WebSocket), it opens into its summary, which heads the next user
message (schemas/responses.py). The client continues with the window plus its next items and no
`previous_response_id`. Calls made before the compaction are only in the summary: a
`function_call_output` answering one of them is a 400, as for any unknown call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from services.codec.admission.tenancy import tenant_of
from services.codec.protocols.common import admit_and_start, open_route
from services.codec.protocols.openai_responses import (
    PROTOCOL,
    PreviousResponseNotFoundError,
    compaction_keys,
    history_of,
    not_found,
)
from services.codec.protocols.openai_responses_events import RESPONSE_ID_PREFIX, new_id, usage_body
from services.codec.protocols.output import Constrained, collect_output_unless_gone, prepare
from services.codec.protocols.schemas.openai import MAX_PROMPT_CACHE_KEY_CHARS, Strict
from services.codec.protocols.schemas.responses import InputItem, ResponsesRequest
from services.common.errors import InvalidRequestError

COMPACTION_ID_PREFIX = "cmp_"
SUMMARY_INSTRUCTIONS = (
    "You compact conversations. Read the transcript the user sends and write a summary that lets an "
    "assistant continue the conversation without it: the user's goals and constraints, the facts and "
    "decisions so far, the functions called with their results, and what is still open. Write plain, "
    "short sentences in the third person, and nothing but the summary."
)

router = APIRouter()


class CompactRequest(Strict):
    """The specification's CompactResponseMethodPublicBody: strict, like every request schema here."""

    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)] | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    instructions: str | None = None
    prompt_cache_key: Annotated[str, Field(max_length=MAX_PROMPT_CACHE_KEY_CHARS)] | None = None

    def check_supported(self) -> None:
        if self.input is None and self.previous_response_id is None:
            raise InvalidRequestError(
                "there is nothing to compact: send input or previous_response_id", "input"
            )

    def conversation_request(self) -> ResponsesRequest:
        """The conversation as a response request would carry it (history_of reads it)."""
        return ResponsesRequest.model_construct(
            model=self.model, input=self.input or [], previous_response_id=self.previous_response_id
        )


@router.post("/v1/responses/compact")
async def compact_response(request: Request) -> Response:
    state, stats, body = await open_route(request, CompactRequest, PROTOCOL)
    model = state.identity.model_name
    try:
        history = await history_of(request, body.conversation_request(), model=model)
    except PreviousResponseNotFoundError as exc:
        return not_found(str(exc), exc.param, "previous_response_not_found")
    summary_request = ResponsesRequest.model_validate(
        {
            "model": body.model,
            "input": transcript(history, body.instructions),
            "temperature": 0.0,
            "max_output_tokens": state.config.responses.compaction_max_output_tokens,
        }
    )
    messages = [{"role": "system", "content": SUMMARY_INSTRUCTIONS}, *summary_request.input_messages()]
    prompt_ids, plan = await prepare(state, messages, tools=None, thinking=None, constraint=None)
    generation = await admit_and_start(
        request,
        state,
        stats,
        Constrained(summary_request.sampling_fields(), plan.constraint),
        prompt_ids,
        max_tokens=summary_request.max_output_tokens,
        logprobs=None,
        prompt_param="input",
        plan=plan,
    )
    outputs, usage = await collect_output_unless_gone(request, generation, plan, 1)
    created_at = int(time.time())
    sealed = compaction_keys(request.app).seal(
        {"summary": outputs[0].text.strip(), "created_at": created_at},
        tenant=tenant_of(request).tenant_id,
        model=model,
    )
    state.metrics.compactions.inc()
    item = {"type": "compaction", "id": new_id(COMPACTION_ID_PREFIX), "encrypted_content": sealed}
    return JSONResponse(
        {
            "id": new_id(RESPONSE_ID_PREFIX),
            "object": "response.compaction",
            "created_at": created_at,
            "output": [item],
            "usage": usage_body(usage),
        }
    )


def transcript(history: list[dict[str, Any]], instructions: str | None) -> str:
    """The conversation as plain text for the summarizer: one line per turn, calls and results named."""
    lines = [f"Instructions: {instructions}"] if instructions else []
    for message in history:
        role = str(message.get("role", "user"))
        if role == "tool":
            lines.append(f"Result of call {message.get('tool_call_id')}: {message.get('content', '')}")
            continue
        if message.get("content"):
            lines.append(f"{role.capitalize()}: {message['content']}")
        for call in message.get("tool_calls") or ():
            lines.append(f"Assistant called {_call_text(call)}")
    return "\n".join(lines) or "(empty conversation)"


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments")
    shown = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{function.get('name')}({shown}) as call {call.get('id')}"
