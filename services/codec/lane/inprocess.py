"""Calling the codec app in-process, as a queued job's tenant (services/codec/admission/tenancy.py
JOB_TENANT): what a drainer does for every job it runs, so queued work takes the whole path an
interactive request takes (rendering, admission, quotas, the fair queue, the result cache, tracing)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from services.codec.admission.tenancy import JOB_TENANT
from services.common import priority
from services.common.tenants import Tenant

REQUEST_ID_HEADER = "x-request-id"
RETRYABLE = frozenset({429, 503, 529})  # a quota, the fair queue or the backend: try again later
REFUSED_FOR_S = 300.0  # a job refused for a quota or overload this long, retried every second, fails


def post_scope(path: str, klass: int) -> dict[str, Any]:
    """An ASGI scope for a JSON POST to `path`, in priority class `klass`."""
    headers = [
        (b"content-type", b"application/json"),
        (priority.HEADER.encode(), priority.name_of(klass).encode()),
    ]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": headers, "client": ("drainer", 0), "server": ("drainer", 0), "state": {},
    }  # fmt: skip


def start(
    app: ASGIApp,
    scope: dict[str, Any],
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
    tenant: Tenant,
) -> asyncio.Future[None]:
    """Start the app on one request as `tenant`: its task copies this context, so the mark reaches the
    request and nothing else."""
    token = JOB_TENANT.set(tenant)
    try:
        return asyncio.ensure_future(app(scope, receive, send))
    finally:
        JOB_TENANT.reset(token)


@dataclass(frozen=True)
class Answer:
    status: int
    request_id: str
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": {"message": self.body.decode(errors="replace")[:500], "type": "server_error"}}


async def post(app: ASGIApp, path: str, body: dict[str, Any], klass: int, tenant: Tenant) -> Answer:
    """POST `body` to `path` and read the whole answer (a request that does not stream)."""
    sent, finished = False, asyncio.Event()
    status, request_id, parts = 500, "", []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await finished.wait()  # the client stays until the answer is whole
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            request_id = headers.get(REQUEST_ID_HEADER, "")
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    call = start(app, post_scope(path, klass), receive, send, tenant)
    try:
        await call
    finally:
        finished.set()
    return Answer(status, request_id, b"".join(parts))
