"""OpenAI Responses: `POST /v1/responses` (non-streamed and streamed), `GET` and `DELETE /v1/responses/{id}`.

The prompt is `instructions` (a system message, never carried over), then the stored conversation of
`previous_response_id` (its earlier turns, input and output, function calls and their outputs
included), then `input`, through the chat template (the tool-aware one, text/assistant.py, when tools
are offered or the conversation holds calls). Function tools and `reasoning` go through the shared
output plan (protocols/output.py): the prompt, the grammar that forces or forbids a call and bounds
thinking, and the split of the output into reasoning, text and calls. Every response object carries
the 32 keys of the Open Responses schema, on the final object and on each lifecycle event. Stream
sequence (`event:` equals the data's `type`; `sequence_number` from 0):

    response.created, response.in_progress        status in_progress, output []
    then per output item, in the order they appear (items in openai_responses_events.py):
      message:   response.output_item.added (in_progress, no content), response.content_part.added (an
                 empty output_text part), response.output_text.delta per text delta,
                 response.output_text.done, response.content_part.done, response.output_item.done
      reasoning: response.output_item.added, response.content_part.added (an empty reasoning_text
                 part), response.reasoning.delta per piece, response.reasoning.done,
                 response.content_part.done, response.output_item.done
      function_call: response.output_item.added (arguments "", in_progress),
                 response.function_call_arguments.delta per fragment,
                 response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete       (max_output_tokens or the context was hit)
    data: [DONE]

A reply without tools or thinking is one message, opened before its first delta. A call does not change
the response's status (completed: the client runs the function and answers with a
`function_call_output` item, usually with `previous_response_id`).

A failure after the first byte sends `error` (the specification's `error` payload, plus OpenAI's
top-level `code`, `message`, `param`), then `response.failed`, then `data: [DONE]`. The same events
go over a WebSocket (openai_responses_ws.py), whose turns come here as HTTP requests carrying the
connection's ConnectionResponses; `/v1/responses/compact` is openai_responses_compact.py. A response
is stored (for GET and continuation) when it completes or is incomplete, unless `store` is false; a store
that fails then is logged and counted (kvrelay_codec_response_store_errors_total), never the response's
failure. Where a stored record is needed (previous_response_id, GET, DELETE) a failed store is a 503.
Stored responses are scoped to the authenticated tenant (admission/tenancy.py; "default" in open
mode): unknown or another tenant's response IDs are a 404.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission import tenancy
from services.codec.admission.gate import resolve_max_tokens
from services.codec.errors import (
    INVALID_REQUEST,
    UnsupportedParameterError,
    WireError,
    error_response,
)
from services.codec.generation import GenerationStream, SampleFinished, Usage
from services.codec.lane.background import JOB_RUN, BackgroundResponses
from services.codec.lane.queue import QueueUnavailableError
from services.codec.protocols.cache_retention import check_retention, retention_breakpoints
from services.codec.protocols.common import admit_and_start, open_route, stream_response
from services.codec.protocols.compaction_keys import CompactionKeys, CompactionRejectedError
from services.codec.protocols.disconnect import run_unless_gone
from services.codec.protocols.openai_responses_background import (
    cancel_background,
    create_background,
    delete_background,
    draft_for,
    retrieve_background,
)
from services.codec.protocols.openai_responses_events import Lifecycle, OutputItems
from services.codec.protocols.output import AssistantEvent, Constrained, OutputPlan, assistant_events, prepare
from services.codec.protocols.schemas.responses import ResponsesRequest, call_ids_of
from services.codec.response_store import ResponseStore, StoredResponse, store_from_config
from services.codec.session import SESSION_HEADER, SessionSource, session_key
from services.codec.state import CodecState
from services.codec.text.chat_template import ChatTemplate
from services.common.config import ResponsesConfig
from services.common.errors import InvalidRequestError

PROTOCOL = "responses"
CONNECTION_STATE = "responses_connection"  # the scope state key of a WebSocket turn's ConnectionResponses
CONNECTION_RESPONSES = 4  # how many of its latest responses a connection keeps for continuation
logger = logging.getLogger(__name__)


class PreviousResponseNotFoundError(InvalidRequestError):
    """`previous_response_id` names no response this tenant stored (a 404, answered by the route)."""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await response_store(app).aclose()  # the queue's client: app.py closes it, after the drainer


router = APIRouter(lifespan=_lifespan)


def install_responses(
    app: FastAPI,
    config: ResponsesConfig,
    store: ResponseStore | None = None,
    background: BackgroundResponses | None = None,
) -> None:
    """Adds the routes, their response store (`store_from_config` unless given), the background
    responses (None: `background: true` is refused) and the keys that seal compacted items to `app`."""
    app.state.responses_store = store if store is not None else store_from_config(config, os.environ)
    app.state.background = background
    app.state.compaction_keys = CompactionKeys.from_file(config.compaction_keys_file)
    app.include_router(router)


def compaction_keys(app: FastAPI) -> CompactionKeys:
    keys: CompactionKeys = app.state.compaction_keys
    return keys


def tenant_of(request: Request) -> str:
    """Whose stored responses this request sees: the authenticated tenant's ID."""
    return tenancy.tenant_of(request).tenant_id


def response_store(app: FastAPI) -> ResponseStore:
    store: ResponseStore = app.state.responses_store
    return store


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state, stats, body = await open_route(request, ResponsesRequest, PROTOCOL)
    store, tenant = response_store(request.app), tenant_of(request)
    check_retention(body.prompt_cache_retention, tenancy.tenant_of(request))
    try:
        history = await history_of(request, body, model=state.identity.model_name)
    except PreviousResponseNotFoundError as exc:
        return not_found(str(exc), exc.param, "previous_response_not_found")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = body.toolset()
    prompt_ids, plan = await prepare(
        state,
        system + history,
        tools=tools,
        thinking=body.thinking(),
        constraint=body.constraint(),
        template=_template_for_calls(state, history),
    )
    if body.background and JOB_RUN.get() is None:  # checked now, run later by a drainer
        info = await state.info.get()
        num_prompt = len(prompt_ids)
        try:
            limit = resolve_max_tokens(
                state.config.limits, num_prompt, body.max_output_tokens, info.max_model_len, "input"
            )
        except InvalidRequestError as exc:
            raise _renamed_max_tokens(exc) from None
        return await create_background(request, state, stats, body, num_prompt + limit)
    try:
        generation = await admit_and_start(
            request,
            state,
            stats,
            Constrained(body.sampling_fields(), plan.constraint),
            prompt_ids,
            max_tokens=body.max_output_tokens,
            logprobs=None,
            prompt_param="input",
            # `history` holds no instructions and starts with the stored conversation of
            # previous_response_id, so every turn of a conversation has the same first user turn.
            session_key=session_key(
                header=request.headers.get(SESSION_HEADER),
                client_key=(SessionSource.PROMPT_CACHE_KEY, body.prompt_cache_key),
                model=state.identity.model_name,
                messages=history,
                tenant=tenant,
            ),
            cache_breakpoints=retention_breakpoints(body.prompt_cache_retention, len(prompt_ids)),
            plan=plan,
            service_tier=body.service_tier,
        )
    except InvalidRequestError as exc:
        raise _renamed_max_tokens(exc) from None
    draft = draft_for(body, state.identity.model_name, thinks=state.assistant.can_think, stats=stats)
    output = OutputItems(draft, plain=plan.is_plain)
    keeper = _Keeper(
        store if body.is_stored else None,
        tenant,
        draft.response_id,
        history,
        generation,
        state,
        connection_responses(request),
    )
    if body.is_stream:
        lifecycle = Lifecycle(draft, output)
        events = _events(assistant_events(generation, plan), lifecycle, keeper)
        return stream_response(request, stats, generation, events, lifecycle.failed)
    finish, usage = await _collect_unless_gone(request, generation, plan, output)
    output.finish(finish)
    final = draft.final(output.bodies(), finish, usage)
    await keeper.keep(final, output)
    return JSONResponse(final)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    """A background response as it stands (its job's result once final, the one answer whichever drainer
    ran it), else a stored one; `stream=true` replays a background response's events. With the queue's
    Redis down a stored response still reads; only one that is not stored is a 503 then."""
    streamed = request.query_params.get("stream", "").lower() == "true"
    try:
        background = await retrieve_background(request, tenant_of(request), response_id)
    except QueueUnavailableError:
        if (
            streamed
            or (record := await response_store(request.app).get(tenant_of(request), response_id)) is None
        ):
            raise
        return JSONResponse(record.body)
    if background is not None:
        return background
    if streamed:
        raise UnsupportedParameterError("only a background response can be streamed again", "stream")
    record = await response_store(request.app).get(tenant_of(request), response_id)
    if record is None:
        return not_found(f"Response with id {response_id!r} not found.", None, "not_found")
    return JSONResponse(record.body)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    cancelled = await cancel_background(request, tenant_of(request), response_id)
    if cancelled is not None:
        return cancelled
    if await response_store(request.app).get(tenant_of(request), response_id) is not None:
        raise InvalidRequestError("only background responses can be cancelled", "response_id")
    return not_found(f"Response with id {response_id!r} not found.", None, "not_found")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    stored = await response_store(request.app).delete(tenant_of(request), response_id)
    if not await delete_background(request, tenant_of(request), response_id) and not stored:
        return not_found(f"Response with id {response_id!r} not found.", None, "not_found")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def history_of(request: Request, body: ResponsesRequest, *, model: str) -> list[dict[str, Any]]:
    """The conversation without instructions: the previous response's (from the WebSocket connection's
    own responses first, then the store), then `input` (whose function_call_output items may answer
    the earlier conversation's calls, and whose compaction items open into their summaries)."""
    tenant = tenant_of(request)
    history: list[dict[str, Any]] = []
    previous_id = body.previous_response_id
    if previous_id is not None:
        local = connection_responses(request)
        conversation = local.get(tenant, previous_id) if local is not None else None
        if conversation is None:
            previous = await response_store(request.app).get(tenant, previous_id)
            conversation = previous.conversation if previous is not None else None
        if conversation is None:
            message = f"Previous response with id {previous_id!r} not found."
            raise PreviousResponseNotFoundError(message, param="previous_response_id")
        history = list(conversation)
    keys = compaction_keys(request.app)

    def open_compaction(blob: str, param: str) -> str:
        try:
            return str(keys.open(blob, tenant=tenant, model=model)["summary"])
        except CompactionRejectedError as exc:
            exc.param = param
            raise

    return history + body.input_messages(call_ids_of(history), open_compaction)


class ConnectionResponses:
    """The latest responses made on one WebSocket connection, stored or not: a continuation with
    `store: false` finds its conversation here (Open Responses: connection-local state). Dropped with
    the socket; a failed continuation evicts what it continued from."""

    def __init__(self, capacity: int = CONNECTION_RESPONSES) -> None:
        self._capacity = capacity
        self._conversations: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()

    def get(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        kept = self._conversations.get(response_id)
        return kept[1] if kept is not None and kept[0] == tenant else None

    def put(self, tenant: str, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._conversations[response_id] = (tenant, conversation)
        while len(self._conversations) > self._capacity:
            self._conversations.popitem(last=False)

    def evict(self, response_id: str) -> None:
        self._conversations.pop(response_id, None)


def connection_responses(request: Request) -> ConnectionResponses | None:
    """The WebSocket connection's responses when this request is one of its turns (openai_responses_ws.py)."""
    local = request.scope.get("state", {}).get(CONNECTION_STATE)
    return local if isinstance(local, ConnectionResponses) else None


def _template_for_calls(state: CodecState, history: list[dict[str, Any]]) -> ChatTemplate | None:
    """The tool-aware template when the conversation holds calls or their results, even if this request
    offers no tools (a follow-up that only answers a call): a template that ignores tools would drop
    them from the prompt. None: `prepare` chooses by the request's tools."""
    if any(message.get("tool_calls") or message.get("role") == "tool" for message in history):
        return state.assistant.tools_template
    return None


def not_found(message: str, param: str | None, code: str) -> Response:
    return error_response(WireError(404, message, INVALID_REQUEST, param, code))


def _renamed_max_tokens(exc: InvalidRequestError) -> InvalidRequestError:
    """Admission names `max_tokens`; this protocol calls it `max_output_tokens`."""
    if exc.param == "max_tokens":
        exc.param = "max_output_tokens"
        exc.args = (str(exc).replace("max_tokens", "max_output_tokens"),)
    return exc


@dataclass
class _Keeper:
    """Stores a finished response with the conversation a continuation starts from (None: not stored)."""

    store: ResponseStore | None
    tenant: str
    response_id: str
    history: list[dict[str, Any]]
    generation: GenerationStream
    state: CodecState
    local: ConnectionResponses | None = None  # a WebSocket turn's connection keeps it too

    async def keep(self, final: dict[str, Any], output: OutputItems) -> None:
        """Never fails the response: the generation happened, so a store that fails is logged and
        counted. The generation's slot and quota are given back first, so a slow store holds neither."""
        conversation = [*self.history, assistant_message(output)]
        if self.local is not None:
            self.local.put(self.tenant, self.response_id, conversation)
        if self.store is None:
            return
        await self.generation.aclose()
        try:
            await self.store.put(self.tenant, StoredResponse(self.response_id, final, conversation))
        except Exception as exc:
            self.state.metrics.response_store_errors.labels(operation="put").inc()
            logger.error(
                "a finished response was not stored",
                extra={"response_id": self.response_id, "error": type(exc).__name__},
            )


def assistant_message(output: OutputItems) -> dict[str, Any]:
    """The response's output as one chat-template assistant turn: its text, then its calls (their
    arguments as objects where they parse). Reasoning is left out, as thinking templates drop it."""
    message: dict[str, Any] = {"role": "assistant", "content": output.message_text()}
    calls = output.calls()
    if calls:
        message["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.text)},
            }
            for call in calls
        ]
    return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _collect(
    events: AsyncIterator[AssistantEvent], output: OutputItems
) -> tuple[SampleFinished | None, Usage]:
    finish: SampleFinished | None = None
    usage = Usage(0, 0, 0)
    async for event in events:
        if isinstance(event, SampleFinished):
            finish = event
        elif isinstance(event, Usage):
            usage = event
        else:
            output.add(event)
    return finish, usage


async def _collect_unless_gone(
    request: Request, generation: GenerationStream, plan: OutputPlan, output: OutputItems
) -> tuple[SampleFinished | None, Usage]:
    """The whole output into `output`; if the client leaves first, the generation is aborted."""
    return await run_unless_gone(
        request, generation, lambda: _collect(assistant_events(generation, plan), output)
    )


async def _events(
    events: AsyncIterator[AssistantEvent], lifecycle: Lifecycle, keeper: _Keeper
) -> AsyncIterator[bytes]:
    for chunk in lifecycle.opening():
        yield chunk
    finish: SampleFinished | None = None
    usage = Usage(0, 0, 0)
    async for event in events:
        if isinstance(event, SampleFinished):
            finish = event
        elif isinstance(event, Usage):
            usage = event
        else:
            for chunk in lifecycle.add(event):
                yield chunk
    ending = lifecycle.end_items(finish)
    final = lifecycle.draft.final(lifecycle.output.bodies(), finish, usage)
    await keeper.keep(final, lifecycle.output)
    for chunk in [*ending, *lifecycle.closing(final)]:
        yield chunk
