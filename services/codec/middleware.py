"""ASGI middleware: request IDs, the body-size limit, the last-resort 500, metrics and the access log.

`RequestContextMiddleware` (outermost) gives every request an ID (a sane client `x-request-id`, else
`req_<hex>`) and an inward ID that is always the server's own (`new_request_ids`), puts them and a
`RequestStats` in the scope state, adds `x-request-id` and the release's headers (model version and
fingerprint, state.CodecIdentity.release_headers) to every response,
turns an exception nothing else handled into a 500 in OpenAI's shape (logged with the ID, never
leaked), and when the response is done records metrics and writes the request's one audit line (JSON,
logger "kvrelay.access"): key ID, tenant, route, status, timings and token counts, never text. A
stream that ended badly after its 200 is logged and counted with the status it would have had (500
failed, 499 client gone) and its `outcome`. Auth (services/codec/admission/auth.py) runs inside it, so a 401
gets its line too. With tracing on, it also opens the request's root span (services/common/tracing.py),
under which the codec's stage spans and the router's spans hang; probes and scrapes are not traced.

Test only: with KVRELAY_TEST_LEAK_KB=N in the environment (`leak_bytes_from_env`), every finished
request's stats are kept forever with N KB of freshly mapped memory beside them, a leak `kvrelay bench soak
--leak-kb` turns on to show that its verdict flags one. It logs a warning at startup; never set it in a
deployment.

`BodyLimitMiddleware` refuses a body over the limit: at once from Content-Length, else while the body
streams in (the read raises BodyTooLargeError, a 413), so an oversize body is never buffered whole.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry.trace import Span, SpanKind, StatusCode
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.codec.backend import results
from services.codec.errors import BodyTooLargeError, describe, error_response
from services.codec.metrics import CodecMetrics, RequestStats
from services.common import tracing
from services.common.priority import HEADER as PRIORITY_HEADER

logger = logging.getLogger("kvrelay.codec.middleware")
access_logger = logging.getLogger("kvrelay.access")

REQUEST_ID_HEADER = "x-request-id"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes log at debug level
LEAK_ENV = "KVRELAY_TEST_LEAK_KB"


def leak_bytes_from_env() -> int:
    """Bytes the test-only leak switch keeps per request (0: off; a bad value is off too)."""
    raw = os.environ.get(LEAK_ENV, "")
    kb = int(raw) if raw.isdigit() else 0
    if kb:
        logger.warning("%s=%d: every request's state is kept forever (a test-only leak)", LEAK_ENV, kb)
    return kb * 1024


def _fresh_pages(size: int) -> mmap.mmap:
    """`size` bytes of memory the process did not hold before, written so that every page is resident: a
    leak that always shows in RSS (malloc would first reuse pages the heap freed earlier)."""
    pages = mmap.mmap(-1, size)
    pages.write(b"\x5a" * size)
    return pages


class RequestContextMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: CodecMetrics,
        leak_bytes: int = 0,
        release_headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.leak_bytes = leak_bytes
        self.release_headers = release_headers  # which release answered (state.CodecIdentity)
        self.leaked: list[tuple[RequestStats, mmap.mmap]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, backend_request_id = _request_ids(scope)
        stats = RequestStats(request_id=request_id)
        scope.setdefault("state", {}).update(
            request_id=request_id, backend_request_id=backend_request_id, stats=stats
        )
        response: dict[str, Any] = {"status": 500, "started": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response.update(status=message["status"], started=True)
                headers = MutableHeaders(scope=message)
                headers.append(REQUEST_ID_HEADER, request_id)
                for name, value in self.release_headers:
                    headers.append(name, value)
                if stats.result_cache is not None:  # hit, miss or skip: the request asked for it
                    headers.append(results.RESPONSE_HEADER, stats.result_cache)
                if stats.priority_class is not None:  # the class that served a generation request
                    headers.append(PRIORITY_HEADER, stats.priority_class)
            await send(message)

        with _request_span(scope, request_id) as span:
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                logger.error(
                    "unhandled %s", type(exc).__name__, exc_info=exc, extra={"request_id": request_id}
                )
                if not response["started"]:
                    await error_response(describe(exc, request_id))(scope, receive, send_with_id)
            finally:
                status = int(response["status"])
                self.metrics.observe_request(stats, status)
                _log_access(scope, stats, status)
                _end_request_span(span, scope, stats, status)
                if self.leak_bytes:
                    self.leaked.append((stats, _fresh_pages(self.leak_bytes)))


class BodyLimitMiddleware:
    """Refuses a request body over `max_body_bytes` (413), or over `larger[path]` on the paths listed
    there (uploads: the Files API, Anthropic's batches)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, larger: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.larger = dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(str(scope.get("path", "")), self.max_body_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await error_response(describe(BodyTooLargeError(limit)))(scope, receive, send)
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, limited_receive, send)


def _request_span(scope: Scope, request_id: str) -> AbstractContextManager[Span]:
    """The root span of the request's trace (a no-op when tracing is off, and for probes and scrapes).
    The codec starts every trace: a client's `traceparent` header is not followed."""
    path = str(scope.get("path", ""))
    if path in QUIET_PATHS:
        return tracing.NO_SPAN
    method = str(scope.get("method", ""))
    attributes = {"http.request.method": method, "url.path": path, "kvrelay.request_id": request_id}
    return tracing.span(f"{method} {path}", kind=SpanKind.SERVER, attributes=attributes)


def _end_request_span(span: Span, scope: Scope, stats: RequestStats, status: int) -> None:
    if not span.is_recording():
        return
    route = getattr(scope.get("route"), "path", None)  # the route's template, when one matched
    if isinstance(route, str):
        span.update_name(f"{scope.get('method', '')} {route}")
        span.set_attribute("http.route", route)
    effective = stats.effective_status(status)
    span.set_attributes(
        {
            "http.response.status_code": status,
            "kvrelay.status": effective,
            "kvrelay.tenant": stats.tenant_id or "",
            "kvrelay.protocol": stats.protocol or "",
            "kvrelay.prompt_tokens": stats.num_prompt_tokens,
            "kvrelay.completion_tokens": stats.num_completion_tokens,
            "kvrelay.cached_tokens": stats.num_cached_tokens,
        }
    )
    if effective >= 500:
        span.set_status(StatusCode.ERROR, f"status {effective}")


def _request_ids(scope: Scope) -> tuple[str, str]:
    return new_request_ids(header(scope, REQUEST_ID_HEADER))


def new_request_ids(given: str | None) -> tuple[str, str]:
    """(the ID the client and the access log see, the ID sent inward) for a client's `x-request-id` (or
    None). The inward ID is always generated here, `req_<24 hex digits>`: inward an ID names one stream,
    and a client's may repeat, or be chosen to match another request's (the router and the workers refuse
    an ID already in flight). A sane client ID is kept for the response header and the logs; without one,
    both IDs are the generated one. Shared with the public gRPC API (its `x-request-id` metadata)."""
    inward = f"req_{secrets.token_hex(12)}"
    if given is not None and _SANE_REQUEST_ID.fullmatch(given):
        return given, inward
    return inward, inward


def header(scope: Scope, name: str) -> str | None:
    """An ASGI scope's header `name` (lower case), the first if repeated; None when absent."""
    wanted = name.encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key.lower() == wanted:
            return bytes(value).decode("latin-1")
    return None


def _content_length(scope: Scope) -> int | None:
    value = header(scope, "content-length")
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


def _log_access(scope: Scope, stats: RequestStats, status: int) -> None:
    path = str(scope.get("path", ""))
    inward = scope.get("state", {}).get("backend_request_id")
    log_access(
        stats,
        status,
        method=str(scope.get("method", "")),
        route=path,
        is_quiet=path in QUIET_PATHS,
        inward_request_id=inward,
    )


def log_access(
    stats: RequestStats,
    status: int,
    *,
    method: str,
    route: str,
    is_quiet: bool = False,
    inward_request_id: str | None = None,
) -> None:
    """One JSON audit line per request: who (key ID, tenant), what (route, status), timings and token
    counts, never text. The public gRPC API logs with it too (method "gRPC", route the full method name,
    status the HTTP-equivalent). `status` is the one the metrics count: a stream that ended badly after
    its 200 logs 500 or 499, with `http_status` 200. `inward_request_id` is the ID the router and the
    workers log for it (the client's own ID is `request_id`). The fields are listed in docs/admission.md."""
    ttft = stats.ttft_s
    queue_wait = stats.queue_wait_s
    fields = {
        "request_id": stats.request_id,
        "inward_request_id": inward_request_id,
        "key_id": stats.key_id,
        "tenant": stats.tenant_id,
        "method": method,
        "route": route,
        "status": stats.effective_status(status),
        "http_status": status,
        "protocol": stats.protocol,
        "outcome": stats.stream_outcome.value if stats.stream_outcome else None,
        "queue_ms": None if queue_wait is None else round(queue_wait * 1000, 3),
        "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
        "e2e_ms": round((time.perf_counter() - stats.started_s) * 1000, 3),
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": stats.num_completion_tokens,
        "cached_tokens": stats.num_cached_tokens,
    }
    access_logger.log(logging.DEBUG if is_quiet else logging.INFO, "request", extra=fields)
