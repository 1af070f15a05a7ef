"""Operational endpoints: liveness, readiness, version and the stack's status.

GET /health    200 {"status": "ok"} while the process serves HTTP (liveness)
GET /ready     200 only when the backend answers and its tokenizer fingerprint equals ours, else 503
GET /version   kvrelay's version, the model name and both sides' fingerprints
GET /status    {"services": [codec, router, workers...]}, each with load and KV-cache counters, and with
               queue.url {"queue": {"up", "classes": [{class, queued, running, oldest_age_s}]}} (the async
               lane's durable queue); with API keys configured, only for an admin key (403 otherwise): it
               names internal addresses
"""

from __future__ import annotations

from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.codec.admission.tenancy import tenant_of
from services.codec.backend.protocol import BackendUnavailableError, ServiceStatus
from services.codec.lane.queue import JobQueue, QueueUnavailableError
from services.codec.state import CodecState, codec_state
from services.common import priority

KV_BLOCK_KEYS = ("total", "active", "cached", "free")
PREFIX_CACHE_KEYS = ("queries", "hits")
TRANSFER_KEYS = ("kv_transfer_bytes_total", "remote_prefills_total", "prefill_fallbacks_total")
WORKER_KEYS = (
    *TRANSFER_KEYS, "weights", "numerics", "small_step_max_tokens", "weight_bytes", "steps_by_path",
    "kv_tiers", "kv_tier_fetched_tokens_total",
)  # fmt: skip

router = APIRouter()


@router.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    result = await codec_state(request).readiness.check()
    status = "ready" if result.is_ready else "not_ready"
    return JSONResponse(
        {"status": status, "reason": result.reason}, status_code=200 if result.is_ready else 503
    )


@router.get("/version")
async def version_info(request: Request) -> JSONResponse:
    state = codec_state(request)
    backend: dict[str, Any] | None = None
    info = state.info.cached
    if info is not None:
        backend = {
            "model_name": info.model_name,
            "model_fingerprint": info.model_fingerprint,
            "tokenizer_fingerprint": info.tokenizer_fingerprint,
        }
    return JSONResponse(
        {
            "version": kvrelay_version(),
            "model": state.identity.model_name,
            "tokenizer_fingerprint": state.identity.tokenizer_fingerprint,
            "model_fingerprint": state.identity.model_fingerprint,
            "backend": backend,
        }
    )


@router.get("/status")
async def status(request: Request) -> JSONResponse:
    state = codec_state(request)
    if not request.app.state.authenticator.is_open and not tenant_of(request).is_admin:
        raise StarletteHTTPException(403, "/status needs an admin key (`kvrelay keys add --admin`)")
    codec = await _codec_status(state)
    try:
        behind = await state.backend.statuses()
    except BackendUnavailableError:
        behind = []
    document: dict[str, Any] = {"services": [_status_body(s) for s in (codec, *behind)]}
    background = getattr(request.app.state, "background", None)
    if background is not None:
        document["queue"] = await _queue_status(background.queue)
    return JSONResponse(document)


async def _queue_status(queue: JobQueue) -> dict[str, Any]:
    try:
        stats = await queue.stats()
    except QueueUnavailableError:
        return {"up": False, "classes": []}
    classes = [
        {"class": priority.name_of(s.priority), "queued": s.queued, "running": s.running,
         "oldest_age_s": round(s.oldest_age_s, 3)}
        for s in stats
    ]  # fmt: skip
    return {"up": True, "classes": classes}


def kvrelay_version() -> str:
    try:
        return version("kvrelay")
    except PackageNotFoundError:
        return "unknown"


async def _codec_status(state: CodecState) -> ServiceStatus:
    server = state.config.server
    readiness = await state.readiness.check()
    return ServiceStatus(
        name="codec",
        role="codec",
        address=f"{server.host}:{server.port}",
        ready=readiness.is_ready,
        running=state.generator.num_running,
        waiting=0,
        requests_total=state.generator.num_requests_total,
    )


def _status_body(service: ServiceStatus) -> dict[str, Any]:
    body = asdict(service)
    body["kv_blocks"] = {key: int(service.kv_blocks.get(key, 0)) for key in KV_BLOCK_KEYS}
    body["prefix_cache"] = {key: int(service.prefix_cache.get(key, 0)) for key in PREFIX_CACHE_KEYS}
    for key in WORKER_KEYS:  # workers only: the codec and the router have no KV transfers or weights
        if body[key] is None:
            del body[key]
    return body
