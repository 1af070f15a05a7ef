"""Anthropic's Message Batches API (docs/batches.md): `POST /v1/messages/batches` (`requests`: each a
`custom_id` and the `params` of a Messages request), `GET /v1/messages/batches` (`before_id`,
`after_id`, `limit`), `GET /v1/messages/batches/{id}`, `POST /v1/messages/batches/{id}/cancel`,
`GET /v1/messages/batches/{id}/results` (JSONL, once ended) and `DELETE /v1/messages/batches/{id}`
(once ended).

Each request runs as a Messages request of the low class, through the same queue and drainers as
OpenAI batches. A request that cannot run (its model not served here, `stream`, params not an object)
ends `errored` with an `invalid_request_error`; a custom_id given twice or malformed is a 400 for the
whole batch, as the API answers. Errors take Anthropic's shape (the path is under /v1/messages).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import ObjectNotFoundError
from services.codec.lane.batch_lines import anthropic_lines
from services.codec.lane.batch_store import OPEN, BatchRow
from services.codec.lane.batches import Batches, anthropic_result
from services.codec.protocols.openai_files import page_limit, require_batches
from services.codec.protocols.request_body import read_json_object
from services.codec.state import codec_state
from services.common.errors import InvalidRequestError

router = APIRouter()

PROCESSING = {"in_progress": "in_progress", "expiring": "in_progress", "cancelling": "canceling"}


def _time(epoch: int | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


async def batch_object(request: Request, batches: Batches, row: BatchRow) -> dict[str, Any]:
    counts = await batches.store.counts(row.batch_id)
    ended = row.status not in OPEN
    results_url = f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{row.batch_id}/results"
    return {
        "id": row.batch_id, "type": "message_batch",
        "processing_status": PROCESSING.get(row.status, "ended"),
        "request_counts": {
            "processing": counts.get("pending", 0), "succeeded": counts.get("succeeded", 0),
            "errored": counts.get("errored", 0), "canceled": counts.get("cancelled", 0),
            "expired": counts.get("expired", 0),
        },
        "ended_at": _time(row.detail.get("finalizing_at")) if ended else None,
        "created_at": _time(row.created_at), "expires_at": _time(row.expires_at), "archived_at": None,
        "cancel_initiated_at": _time(row.detail.get("cancelling_at")),
        "results_url": results_url if ended else None,
    }  # fmt: skip


async def _own(request: Request, batch_id: str) -> tuple[Batches, BatchRow]:
    batches = require_batches(request)
    row = await batches.store.batch(tenant_of(request).tenant_id, batch_id)
    if row is None or row.api != "anthropic":
        raise ObjectNotFoundError("message batch", batch_id)
    return batches, row


@router.post("/v1/messages/batches")
async def create_batch(request: Request) -> Response:
    batches = require_batches(request)
    body = await read_json_object(request)
    unknown = sorted(set(body) - {"requests"})
    if unknown:
        raise InvalidRequestError(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    requests = body.get("requests")
    if not isinstance(requests, list):
        raise InvalidRequestError("requests: a list of requests is required", "requests")
    model = codec_state(request).identity.model_name
    lines = await asyncio.to_thread(
        anthropic_lines, requests, lambda name: name == model, batches.config.max_lines
    )
    row = await batches.create(tenant_of(request), "anthropic", lines, {})
    return JSONResponse(await batch_object(request, batches, row))


@router.get("/v1/messages/batches")
async def list_batches(request: Request) -> Response:
    batches = require_batches(request)
    query = request.query_params
    limit = page_limit(query.get("limit"), 20, 1000)
    if query.get("before_id") is not None and query.get("after_id") is not None:
        raise InvalidRequestError("give before_id or after_id, not both", "before_id")
    rows = await batches.store.batches(
        tenant_of(request).tenant_id, "anthropic", after=query.get("after_id"), before=query.get("before_id"),
        limit=limit + 1,
    )  # fmt: skip
    more = len(rows) > limit
    rows = rows[:limit] if query.get("before_id") is None else rows[-limit:]
    data = [await batch_object(request, batches, row) for row in rows]
    return JSONResponse(
        {
            "data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )  # fmt: skip


@router.get("/v1/messages/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    batches, row = await _own(request, batch_id)
    return JSONResponse(await batch_object(request, batches, row))


@router.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    batches, row = await _own(request, batch_id)
    row = await batches.cancel(row.tenant, batch_id) or row
    return JSONResponse(await batch_object(request, batches, row))


@router.get("/v1/messages/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> Response:
    batches, row = await _own(request, batch_id)
    if row.status in OPEN:
        raise InvalidRequestError(f"message batch {batch_id!r} has not ended yet: its results come then")
    lines = await batches.store.lines(batch_id)

    async def jsonl() -> AsyncIterator[bytes]:
        for line in lines:
            yield (json.dumps(anthropic_result(line)) + "\n").encode()

    return StreamingResponse(jsonl(), media_type="application/binary")


@router.delete("/v1/messages/batches/{batch_id}")
async def delete_batch(request: Request, batch_id: str) -> Response:
    batches, row = await _own(request, batch_id)
    if not await batches.store.delete_batch(row.tenant, batch_id):
        raise InvalidRequestError(f"message batch {batch_id!r} is still processing: cancel it first")
    return JSONResponse({"id": batch_id, "type": "message_batch_deleted"})
