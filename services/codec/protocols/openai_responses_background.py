"""Background Responses (`background: true`): queued at creation, run by a drainer, read from any codec.

`POST /v1/responses` with `background: true` (it needs `store`, and a queue: `queue.url`): the request is
checked as any other (its prompt rendered and counted, its priority class resolved against the key,
400s now rather than later), kept `queued` on the queue's Redis (services/codec/lane/background.py) and
answered at once with the `queued` response; with `stream: true` the answer is its events, followed
until it ends. A drainer (services/codec/lane/drainer.py) runs it later through this same route, as the job's
tenant and class (`JOB_RUN` marks that request: it runs instead of queueing again, under the queued ID).

- `GET /v1/responses/{id}`: a background response as it stands, from any codec replica.
- `GET /v1/responses/{id}?stream=true[&starting_after=N]`: its events after sequence number N (from the
  start without it), then the live ones until it ends; `data: [DONE]` closes the stream.
- `DELETE /v1/responses/{id}`: forgets it (cancelling it first if it has not ended).
- `POST /v1/responses/{id}/cancel`: a queued response is cancelled at once and never runs; a running
  one is stopped by its drainer within a moment (its output so far is kept). The answer is the response
  with status `cancelled`; cancelling one that already ended answers it unchanged. Only background
  responses can be cancelled (a 400 otherwise).

Caps: a tenant's queued and running jobs and tokens (`quotas.default_max_queued_jobs`, `..._tokens`, or
the tenant's own): past either, a 429. No queue configured: a 400 naming `background`. The queue's Redis
down: a 503; interactive requests do not touch it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import UnsupportedParameterError, describe
from services.codec.lane.background import JOB_RUN, KIND, BackgroundRecord, BackgroundResponses, cancelled
from services.codec.lane.queue import Job
from services.codec.metrics import RequestStats
from services.codec.protocols.openai_responses_events import ResponseDraft
from services.codec.protocols.schemas.responses import ResponsesRequest
from services.codec.protocols.service_tier import HEADER as PRIORITY_HEADER
from services.codec.protocols.service_tier import resolve_class, served_tier
from services.codec.protocols.sse import DONE, EventStreamResponse, encode_event
from services.codec.state import CodecState, codec_state, request_id
from services.common import priority
from services.common.config import QuotasConfig
from services.common.errors import InvalidRequestError


def background_of(request: Request) -> BackgroundResponses | None:
    return getattr(request.app.state, "background", None)


def require_background(request: Request) -> BackgroundResponses:
    background = background_of(request)
    if background is None:
        raise UnsupportedParameterError(
            "background responses need the async lane's queue, which this server has not configured "
            "(queue.url: docs/async.md)",
            "background",
        )
    return background


def queue_caps(quotas: QuotasConfig, tenant: str) -> tuple[int | None, int | None]:
    """The tenant's caps on queued jobs and tokens (its own, else the defaults)."""
    own = quotas.tenants.get(tenant)
    jobs = own.max_queued_jobs if own is not None and own.max_queued_jobs else quotas.default_max_queued_jobs
    tokens = (
        own.max_queued_tokens
        if own is not None and own.max_queued_tokens
        else quotas.default_max_queued_tokens
    )
    return jobs, tokens


async def create_background(
    request: Request, state: CodecState, stats: RequestStats, body: ResponsesRequest, num_tokens: int
) -> Response:
    """Queue the checked request `body` (whose prompt and output may take `num_tokens`): kept `queued`,
    answered at once."""
    background = require_background(request)
    tenant = tenant_of(request)
    stats.priority_class = resolve_class(body.service_tier, request.headers.get(PRIORITY_HEADER), tenant)
    draft = draft_for(body, state.identity.model_name, thinks=state.assistant.can_think, stats=stats)
    queued = draft.body("queued", [])
    job = Job(
        draft.response_id, tenant.tenant_id, KIND, body.model_dump(mode="json", exclude_unset=True),
        priority.BY_NAME[stats.priority_class], num_tokens, tenant.key_id, float(draft.created_at),
    )  # fmt: skip
    queued_event = {"type": "response.queued", "sequence_number": 0, "response": queued}
    caps = queue_caps(state.config.quotas, tenant.tenant_id)
    await background.create(job, queued, queued_event, caps=caps)
    if not body.stream:
        return JSONResponse(queued)
    return _event_stream(request, _events(background, draft.response_id, -1))


def draft_for(body: ResponsesRequest, model: str, *, thinks: bool, stats: RequestStats) -> ResponseDraft:
    """The response's draft: a drainer's run keeps the queued response's ID and creation time."""
    run = JOB_RUN.get()
    draft = ResponseDraft.new(body, model, thinks=thinks, service_tier=served_tier(stats))
    if run is None:
        return draft
    # The message's ID follows from the response's: a re-run after a takeover names the same item.
    message_id = "msg_" + run.response_id.removeprefix("resp_")
    return ResponseDraft(
        run.response_id, message_id, run.created_at, model, body, draft.reasoning, draft.service_tier
    )


async def retrieve_background(request: Request, tenant: str, response_id: str) -> Response | None:
    """A background response (or its events, with `stream=true`); None when there is no such one."""
    background = background_of(request)
    if background is None:
        return None
    record = await background.get(tenant, response_id)
    if record is None:
        return None
    if request.query_params.get("stream", "").lower() != "true":
        return JSONResponse(record.body)
    after = _starting_after(request.query_params.get("starting_after"))
    return _event_stream(request, _events(background, response_id, after))


async def cancel_background(request: Request, tenant: str, response_id: str) -> Response | None:
    """Cancel a background response; None when there is no such one (a 404)."""
    background = background_of(request)
    record = await background.get(tenant, response_id) if background is not None else None
    if background is None or record is None:
        return None
    if not record.body.get("background"):
        raise InvalidRequestError("only background responses can be cancelled", "response_id")
    if record.is_over:
        return JSONResponse(record.body)
    await background.queue.cancel(response_id)
    ended = cancelled(record.body)
    await background.put(BackgroundRecord(tenant, ended))
    return JSONResponse(ended)


async def delete_background(request: Request, tenant: str, response_id: str) -> bool:
    """Forget a background response (cancelled first if it has not ended); False when there is none."""
    background = background_of(request)
    record = await background.get(tenant, response_id) if background is not None else None
    if background is None or record is None:
        return False
    if not record.is_over:
        await background.queue.cancel(response_id)
    await background.forget(response_id)
    return True


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        after = int(value)
    except ValueError:
        raise InvalidRequestError("starting_after must be an integer", "starting_after") from None
    if after < -1:
        raise InvalidRequestError("starting_after must be at least -1", "starting_after")
    return after


def _event_stream(request: Request, events: AsyncIterator[bytes]) -> EventStreamResponse:
    rid = request_id(request)
    return EventStreamResponse(
        events,
        request_id=rid,
        error_event=lambda exc: encode_event(describe(exc, rid).body()),
        send_timeout_s=codec_state(request).stream_send_timeout_s,
    )


async def _events(background: BackgroundResponses, response_id: str, after: int) -> AsyncIterator[bytes]:
    async for event in background.events_after(response_id, after):
        yield encode_event(event, event=event["type"])
    yield DONE
