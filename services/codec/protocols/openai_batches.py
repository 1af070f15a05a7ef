"""OpenAI's Batches API (docs/batches.md): `POST /v1/batches`, `GET /v1/batches` (`after`, `limit`),
`GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`.

A batch names an uploaded file (purpose `batch`) and one endpoint: /v1/chat/completions,
/v1/completions or /v1/responses. Its lines are checked at creation (services/codec/lane/batch_lines.py):
a bad line becomes an error record, never a failed batch; a custom_id given twice, an empty file or one
over `batches.max_lines` is a 400. `completion_window` must be `24h`, as the API says; the server's own
window is `batches.completion_window_s` (24 hours unless configured shorter). The output file holds the
lines answered 200, the error file every other line (an error status with its body, a refused line
with its code, `batch_cancelled` and `batch_expired` for lines that never ran), each keyed by custom_id.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import ObjectNotFoundError
from services.codec.lane.batch_lines import OPENAI_ENDPOINTS, openai_lines
from services.codec.lane.batch_store import BatchRow
from services.codec.lane.batches import Batches
from services.codec.protocols.openai_files import expiry_seconds, list_page, page_limit, require_batches
from services.codec.protocols.request_body import read_json_object
from services.codec.state import codec_state
from services.common.errors import InvalidRequestError

router = APIRouter()

STATUS = {"expiring": "finalizing"}  # the store's own states, as the API names them
_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")


async def batch_object(batches: Batches, row: BatchRow) -> dict[str, Any]:
    counts = await batches.store.counts(row.batch_id)
    detail = row.detail
    failed = sum(counts.get(outcome, 0) for outcome in ("errored", "cancelled", "expired"))
    return {
        "id": row.batch_id, "object": "batch", "endpoint": detail["endpoint"], "errors": None,
        "input_file_id": detail["input_file_id"], "completion_window": "24h",
        "status": STATUS.get(row.status, row.status), "output_file_id": detail.get("output_file_id"),
        "error_file_id": detail.get("error_file_id"), "created_at": row.created_at,
        "in_progress_at": row.created_at, "expires_at": row.expires_at,
        "finalizing_at": detail.get("finalizing_at"), "completed_at": detail.get("completed_at"),
        "failed_at": None, "expired_at": detail.get("expired_at"),
        "cancelling_at": detail.get("cancelling_at"), "cancelled_at": detail.get("cancelled_at"),
        "request_counts": {"total": row.num_lines, "completed": counts.get("succeeded", 0), "failed": failed},
        "metadata": detail.get("metadata"), "model": detail.get("model"),
    }  # fmt: skip


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    batches = require_batches(request)
    state, tenant = codec_state(request), tenant_of(request)
    body = await read_json_object(request)
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise InvalidRequestError(f"unknown parameter: {unknown[0]}", unknown[0])
    endpoint = body.get("endpoint")
    if endpoint not in OPENAI_ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint must be one of {', '.join(OPENAI_ENDPOINTS)}, not {endpoint!r}", "endpoint"
        )
    if body.get("completion_window") != "24h":
        raise InvalidRequestError("completion_window must be '24h'", "completion_window")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise InvalidRequestError("input_file_id must be a file ID", "input_file_id")
    file = await batches.store.file(tenant.tenant_id, file_id)
    content = await batches.store.content(tenant.tenant_id, file_id) if file is not None else None
    if file is None or content is None:
        raise ObjectNotFoundError("file", file_id, "input_file_id")
    if file.purpose != "batch":
        raise InvalidRequestError(f"the file's purpose is {file.purpose!r}, not 'batch'", "input_file_id")
    model = state.identity.model_name
    lines = await asyncio.to_thread(  # up to max_file_bytes of JSON: off the event loop
        openai_lines, content, endpoint, lambda name: name == model, batches.config.max_lines
    )
    detail = {
        "endpoint": endpoint, "input_file_id": file_id, "metadata": metadata, "model": model,
        "output_ttl_s": expiry_seconds(body.get("output_expires_after"), "output_expires_after"),
    }  # fmt: skip
    row = await batches.create(tenant, "openai", lines, detail)
    return JSONResponse(await batch_object(batches, row))


@router.get("/v1/batches")
async def list_batches(request: Request) -> Response:
    batches = require_batches(request)
    limit = page_limit(request.query_params.get("limit"), 20, 100)
    rows = await batches.store.batches(
        tenant_of(request).tenant_id, "openai", after=request.query_params.get("after"), before=None,
        limit=limit + 1,
    )  # fmt: skip
    return list_page([await batch_object(batches, row) for row in rows[:limit]], len(rows) > limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    batches = require_batches(request)
    row = await batches.store.batch(tenant_of(request).tenant_id, batch_id)
    if row is None or row.api != "openai":
        raise ObjectNotFoundError("batch", batch_id)
    return JSONResponse(await batch_object(batches, row))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    batches = require_batches(request)
    tenant = tenant_of(request).tenant_id
    row = await batches.store.batch(tenant, batch_id)
    if row is None or row.api != "openai":
        raise ObjectNotFoundError("batch", batch_id)
    row = await batches.cancel(tenant, batch_id) or row
    return JSONResponse(await batch_object(batches, row))


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                   for k, v in value.items())
    ):  # fmt: skip
        raise InvalidRequestError(
            "metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters", "metadata"
        )
    return value
