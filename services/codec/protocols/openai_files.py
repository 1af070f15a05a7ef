"""OpenAI's Files API, for batch input (docs/batches.md): `POST /v1/files` (multipart: `file`,
`purpose`, optional `expires_after[anchor]`/`expires_after[seconds]`), `GET /v1/files` (`purpose`,
`limit`, `after`, `order`), `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

Files live in the batch store (PostgreSQL) with their tenant: another tenant's file ID is a 404. Only
purpose `batch` is accepted for upload; a batch's output and error files have purpose `batch_output`.
Caps: `batches.max_file_bytes` per file (413), `batches.max_files` per tenant (400 `file_limit_reached`);
files expire `batches.file_ttl_s` after creation unless `expires_after` says otherwise (1 hour to 30
days).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from services.codec.admission.tenancy import tenant_of
from services.codec.errors import BodyTooLargeError, ObjectNotFoundError
from services.codec.lane.batch_store import FileRow
from services.codec.lane.batches import Batches
from services.common.errors import InvalidRequestError

router = APIRouter()

MAX_LIST = 10_000
MIN_TTL_S, MAX_TTL_S = 3600, 30 * 24 * 3600


def require_batches(request: Request) -> Batches:
    """The app's batches; a 400 saying how to configure them when there are none."""
    batches: Batches | None = getattr(request.app.state, "batches", None)
    if batches is None:
        raise InvalidRequestError(
            "files and batches need the batch store and the async lane's queue, which this server has not "
            "configured (batches.store_url and queue.url: docs/batches.md)"
        )
    return batches


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.file_id, "object": "file", "bytes": row.num_bytes, "created_at": row.created_at,
        "expires_at": row.expires_at, "filename": row.filename, "purpose": row.purpose,
        "status": "processed", "status_details": None,
    }  # fmt: skip


def list_page(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    """A page of a list route, in OpenAI's cursor shape."""
    return JSONResponse(
        {
            "object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
        }
    )  # fmt: skip


def page_limit(value: str | None, default: int, most: int) -> int:
    if value is None:
        return default
    try:
        limit = int(value)
    except ValueError:
        raise InvalidRequestError("limit must be an integer", "limit") from None
    if not 1 <= limit <= most:
        raise InvalidRequestError(f"limit must be between 1 and {most}", "limit")
    return limit


@router.post("/v1/files")
async def create_file(request: Request) -> Response:
    batches = require_batches(request)
    form = await request.form(max_files=1, max_fields=8)
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError("a multipart part named 'file' holding the file is required", "file")
    if purpose != "batch":
        raise InvalidRequestError(f"purpose must be 'batch' here, not {purpose!r}", "purpose")
    ttl_s = _ttl(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
    content = await upload.read()
    if len(content) > batches.config.max_file_bytes:
        raise BodyTooLargeError(batches.config.max_file_bytes)
    filename = (upload.filename or "input.jsonl").replace("\x00", "")[:255]
    filename = filename.encode("utf-8", "replace").decode("utf-8")  # no lone surrogate: a text column
    row = await batches.add_file(tenant_of(request).tenant_id, "batch", filename, content, ttl_s)
    return JSONResponse(file_object(row))


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    batches = require_batches(request)
    query = request.query_params
    limit = page_limit(query.get("limit"), MAX_LIST, MAX_LIST)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'", "order")
    rows = await batches.store.files(
        tenant_of(request).tenant_id,
        purpose=query.get("purpose"),
        after=query.get("after"),
        limit=limit + 1,
        newest_first=order == "desc",
    )
    return list_page([file_object(row) for row in rows[:limit]], len(rows) > limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> Response:
    row = await require_batches(request).store.file(tenant_of(request).tenant_id, file_id)
    if row is None:
        raise ObjectNotFoundError("file", file_id)
    return JSONResponse(file_object(row))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    content = await require_batches(request).store.content(tenant_of(request).tenant_id, file_id)
    if content is None:
        raise ObjectNotFoundError("file", file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    if not await require_batches(request).store.delete_file(tenant_of(request).tenant_id, file_id):
        raise ObjectNotFoundError("file", file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def expiry_seconds(value: Any, param: str) -> int | None:
    """An `expires_after` object's seconds (`anchor: created_at`, 1 hour to 30 days); None when absent."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object with anchor and seconds", param)
    return _ttl(value.get("anchor"), value.get("seconds"), param)


def _ttl(anchor: Any, seconds: Any, param: str = "expires_after") -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequestError(f"{param}.anchor must be 'created_at'", param)
    try:
        ttl_s = int(str(seconds))
    except ValueError:
        raise InvalidRequestError(f"{param}.seconds must be an integer", param) from None
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise InvalidRequestError(f"{param}.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}", param)
    return ttl_s
