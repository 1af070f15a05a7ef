"""The Responses API over WebSocket at `/v1/responses` (Open Responses 2026-04-24, WebSocket Transport).

A client opens one socket (authenticated at the upgrade with the same keys as HTTP: a refused
upgrade is answered as HTTP, 401 in OpenAI's shape) and sends `response.create` events: the body of
`POST /v1/responses` plus `"type": "response.create"`, without `stream`, `stream_options` or
`background`. Each turn runs as one in-process `POST /v1/responses` with `"stream": true` through the
whole HTTP stack (request ID, access line, auth, body limit, quotas, the route itself), and every SSE
event it writes goes out as one text frame holding exactly the event's JSON; so the events, their
order and `sequence_number` are those of HTTP, event for event, and no per-turn code is duplicated.

Per connection:
- at most one response in flight; further `response.create` messages wait in order, up to
  `responses.websocket.max_queued` (4), past which a message is refused with a 429 error event;
- continuation: the turn carries the connection's ConnectionResponses (openai_responses.py), so
  `previous_response_id` finds the connection's own latest responses even with `store: false`, then the
  store; a turn that continues and fails (a 4xx/5xx before its stream, or `response.failed`) evicts
  the response it continued from, so retrying it is `previous_response_not_found`;
- a lifetime of `responses.websocket.max_lifetime_s` (the specification's 60 minutes): past it, once
  no response is in flight, an error event `websocket_connection_limit_reached`, then close 1000;
- keepalive pings every `ping_interval_s` (uvicorn's), frames over `max_frame_bytes` closed with 1009,
  text that is not UTF-8 with 1007 (both by the WebSocket library);
- open sockets count against `server.max_connections` (past it the upgrade is a 503), as uvicorn
  counts them against the HTTP requests it admits.

Errors are the specification's envelope, `{"type": "error", "status", "error": {"type", "code",
"message", "param"}}`, and leave the socket open: malformed JSON, a frame that is not a JSON object,
an unknown event type (400), a refused turn (its HTTP status and error). A binary frame gets an error
event, then close 1003. Closing the socket mid-stream ends the turn as an HTTP client that left does
(the generation aborted everywhere, its KV freed); a client that stops reading hits the stream's
send timeout (`limits.stream_send_timeout_ms`) the same way, and its socket is then closed. On
SIGTERM (`WebSocketHub.drain`, called by the server before uvicorn's own shutdown) no new socket is
accepted, each socket finishes the response in flight, then gets an error event `server_shutting_down`
(503) and close 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.codec.admission.auth import AUTHORIZATION, X_API_KEY, Authenticator
from services.codec.errors import AuthenticationError, WireError, describe, error_response
from services.codec.metrics import CodecMetrics
from services.codec.middleware import REQUEST_ID_HEADER, header
from services.codec.protocols.openai_responses import CONNECTION_STATE, ConnectionResponses
from services.common.config import WebSocketConfig

logger = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
HTTP_ONLY_FIELDS = ("stream", "stream_options", "background")  # the specification forbids them here
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_SEND_TIMEOUT_S = 1.0  # closing a socket whose client stopped reading: we try, briefly
_DROPPED_HEADERS = {b"content-length", b"content-type", REQUEST_ID_HEADER.encode()}  # each turn has its own


def error_event(
    status: int, code: str, message: str, param: str | None = None, kind: str = ""
) -> dict[str, Any]:
    """The specification's WebSocket error envelope."""
    error_type = kind or ("server_error" if status >= 500 else "invalid_request_error")
    return {
        "type": "error",
        "status": status,
        "error": {"type": error_type, "code": code, "message": message, "param": param},
    }


class WebSocketHub:
    """The open Responses sockets of one app: counted against the connection limit, drained on SIGTERM."""

    def __init__(self, config: WebSocketConfig, max_connections: int, metrics: CodecMetrics) -> None:
        self.config = config
        self.max_connections = max_connections
        self.metrics = metrics
        self.connections: set[_Connection] = set()
        self.draining = False

    async def drain(self) -> None:
        """No new sockets; each open one finishes its response in flight, then gets an error and 1001."""
        self.draining = True
        for connection in list(self.connections):
            connection.stop.set()
        closing = [connection.closed.wait() for connection in list(self.connections)]
        if closing:
            await asyncio.gather(*closing)


class ResponsesWebSocketMiddleware:
    """Outermost ASGI middleware: takes WebSocket connections to RESPONSES_PATH, passes the rest on.
    Each turn goes back through `self.app` (the whole HTTP stack) as an HTTP request."""

    def __init__(self, app: ASGIApp, hub: WebSocketHub, authenticator: Authenticator) -> None:
        self.app = app
        self.hub = hub
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        if (await receive())["type"] != "websocket.connect":
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _deny(scope, send, refusal)
            return
        await send({"type": "websocket.accept"})
        connection = _Connection(self, scope, receive, send)
        self.hub.connections.add(connection)
        self.hub.metrics.websocket_connections.inc()
        try:
            await connection.run()
        finally:
            self.hub.connections.discard(connection)
            self.hub.metrics.websocket_connections.dec()
            self.hub.metrics.websocket_responses.observe(connection.num_responses)
            connection.closed.set()

    def _refusal(self, scope: Scope) -> WireError | None:
        """Why this upgrade is refused (answered as HTTP), or None."""
        if scope.get("path") != RESPONSES_PATH:
            return WireError(404, f"no WebSocket endpoint at {scope.get('path')}", "invalid_request_error")
        try:
            self.authenticator.authenticate(header(scope, AUTHORIZATION), header(scope, X_API_KEY))
        except AuthenticationError as exc:
            self.hub.metrics.observe_auth_failure(exc.reason)
            return describe(exc)
        if self.hub.draining:
            return WireError(503, "the server is shutting down", "server_error", None, "server_shutting_down")
        if len(self.hub.connections) >= self.hub.max_connections:
            return WireError(503, "too many open connections", "server_error", None, "too_many_connections")
        return None


class _Connection:
    """One socket: a reader that queues `response.create` messages, and a loop that runs them in order."""

    def __init__(
        self, owner: ResponsesWebSocketMiddleware, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.owner = owner
        self.config = owner.hub.config
        self.scope = scope
        self.receive = receive
        self._send = send
        self.pending: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.gone = asyncio.Event()  # the client closed the socket (or it broke)
        self.stop = asyncio.Event()  # the server drains
        self.closed = asyncio.Event()  # this connection's handler has returned
        self.responses = ConnectionResponses()
        self.num_responses = 0
        self._busy = False
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self._serve()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.max_lifetime_s
        while not self.gone.is_set():
            event = await self._next(deadline - loop.time())
            if event is None:
                break
            self._busy = True
            try:
                stopped_reading = await self._turn(event)
            finally:
                self._busy = False
            if stopped_reading:
                await self._close(CLOSE_POLICY, timeout_s=CLOSE_SEND_TIMEOUT_S)
                return
        if self.gone.is_set():
            return
        if self.stop.is_set():
            await self.send_json(error_event(503, "server_shutting_down", "the server is shutting down"))
            await self._close(CLOSE_GOING_AWAY)
        else:
            message = f"the connection reached its limit of {self.config.max_lifetime_s:g} s; open a new one"
            await self.send_json(error_event(400, "websocket_connection_limit_reached", message))
            await self._close(CLOSE_NORMAL)

    async def _next(self, timeout_s: float) -> dict[str, Any] | None:
        """The next queued `response.create`; None when the socket is gone, the server drains, or the
        lifetime is over."""
        if timeout_s <= 0 or self.stop.is_set():
            return None
        taking = asyncio.ensure_future(self.pending.get())
        waits = {taking, asyncio.ensure_future(self.gone.wait()), asyncio.ensure_future(self.stop.wait())}
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in waits - done:
            task.cancel()
        if taking not in done:
            return None
        event = taking.result()
        if self.gone.is_set() or self.stop.is_set():  # taken just as the socket ends: not served
            return None
        return event

    async def _read(self) -> None:
        """Queues each `response.create`; answers bad frames with an error event. Ends when the
        socket does."""
        with contextlib.suppress(_SocketGone):
            await self._read_frames()
        self.gone.set()

    async def _read_frames(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                await self.send_json(
                    error_event(400, "unsupported_frame", "binary frames are not accepted; send JSON text")
                )
                await self._close(CLOSE_UNSUPPORTED_DATA)
                return
            await self._accept(message.get("text") or "")

    async def _accept(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError as exc:
            await self.send_json(error_event(400, "invalid_json", f"the message is not valid JSON: {exc}"))
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.send_json(
                error_event(
                    400, "invalid_event", "each message must be a JSON object with a string `type`", "type"
                )
            )
            return
        if event["type"] != "response.create":
            message = f"unknown event type {event['type']!r}: the only client event is response.create"
            await self.send_json(error_event(400, "unknown_event_type", message, "type"))
            return
        if self.pending.qsize() >= self.config.max_queued:
            message = (
                f"{self.config.max_queued} response.create messages already wait behind the response in "
                "flight; send the next one when a response ends"
            )
            await self.send_json(
                error_event(429, "too_many_queued_responses", message, kind="rate_limit_error")
            )
            return
        self.pending.put_nowait(event)

    async def _turn(self, event: dict[str, Any]) -> bool:
        """Runs one response; True when its client stopped reading (the socket is then closed)."""
        previous = event.get("previous_response_id")
        self.num_responses += 1
        banned = next((name for name in HTTP_ONLY_FIELDS if name in event), None)
        if banned is not None:
            message = f"{banned} is an HTTP field and must not be sent in a WebSocket response.create"
            await self.send_json(error_event(400, "invalid_request_error", message, banned))
            failed, stopped_reading = True, False
        else:
            body = {**{key: value for key, value in event.items() if key != "type"}, "stream": True}
            relay = _TurnRelay(self)
            await self.owner.app(self._turn_scope(), relay.receive(body), relay.send)
            failed, stopped_reading = await relay.finish()
        if failed and isinstance(previous, str):
            self.responses.evict(previous)
        return stopped_reading

    def _turn_scope(self) -> Scope:
        scope = self.scope
        headers = [(name, value) for name, value in scope.get("headers", []) if name not in _DROPPED_HEADERS]
        return {
            "type": "http",
            "asgi": scope.get("asgi", {"version": "3.0"}),
            "http_version": "1.1",
            "method": "POST",
            "scheme": "https" if scope.get("scheme") == "wss" else "http",
            "path": RESPONSES_PATH,
            "raw_path": RESPONSES_PATH.encode(),
            "query_string": b"",
            "root_path": scope.get("root_path", ""),
            "headers": [*headers, (b"content-type", b"application/json")],
            "client": scope.get("client"),
            "server": scope.get("server"),
            "app": scope.get("app"),
            "state": {**scope.get("state", {}), CONNECTION_STATE: self.responses},
        }

    async def send_json(self, payload: dict[str, Any]) -> None:
        await self.send_text(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))

    async def send_text(self, text: str) -> None:
        """One text frame; a socket already gone swallows it."""
        if self.gone.is_set():
            raise _SocketGone()
        async with self._send_lock:
            try:
                await self._send({"type": "websocket.send", "text": text})
            except (OSError, RuntimeError) as exc:  # uvicorn's ClientDisconnected is an OSError
                self.gone.set()
                raise _SocketGone() from exc

    async def _close(self, code: int, timeout_s: float | None = None) -> None:
        with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError):
            await asyncio.wait_for(self._send({"type": "websocket.close", "code": code}), timeout_s)


class _SocketGone(ConnectionError):
    """The socket closed while a frame was being sent: an OSError, as ASGI servers report a closed
    connection, so the turn's stream ends as a client that left."""


class _TurnRelay:
    """One turn's ASGI side: hands the route its body, then a disconnect once the socket is gone; turns
    the SSE it writes into text frames (and a refusal before the stream into one error event)."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.status = 0
        self.is_stream = False
        self.buffer = b""
        self.failed = False
        self.stopped_reading = False

    def receive(self, body: dict[str, Any]) -> Receive:
        raw = json.dumps(body, ensure_ascii=False).encode()
        first = True

        async def receive() -> Message:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": raw, "more_body": False}
            await self.connection.gone.wait()
            return {"type": "http.disconnect"}

        return receive

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.is_stream = self.status == 200 and content_type.startswith(b"text/event-stream")
            return
        if message["type"] != "http.response.body":
            return
        self.buffer += message.get("body", b"")
        if not self.is_stream:
            return
        while b"\n\n" in self.buffer:
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            data = _sse_data(block)
            if data is None or data == "[DONE]":
                continue
            if data.startswith('{"type":"response.failed"') or data.startswith('{"type":"error"'):
                self.failed = True
            try:
                await self.connection.send_text(data)
            except asyncio.CancelledError:
                self.stopped_reading = True  # the stream's send timeout gave up on this frame
                raise

    async def finish(self) -> tuple[bool, bool]:
        """(failed, stopped_reading) once the route returned; a refusal becomes its error event."""
        if not self.is_stream:
            self.failed = True
            error = _error_of(self.buffer)
            with contextlib.suppress(_SocketGone):
                await self.connection.send_json(
                    error_event(
                        self.status or 500,
                        str(error.get("code") or error.get("type") or "server_error"),
                        str(error.get("message") or "the request failed"),
                        error.get("param"),
                        str(error.get("type") or ""),
                    )
                )
        return self.failed, self.stopped_reading


def _sse_data(block: bytes) -> str | None:
    """The `data:` of one SSE event (None for a comment or keepalive)."""
    lines = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8") if lines else None


def _error_of(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body (empty when it is not one)."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return {}
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else {}


async def _deny(scope: Scope, send: Send, error: WireError) -> None:
    """Refuses an upgrade with an HTTP response in OpenAI's shape (the ASGI denial extension), or with
    close 1008 where the server lacks it."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": CLOSE_POLICY})
        return

    async def denial_send(message: Message) -> None:
        await send({**message, "type": message["type"].replace("http.", "websocket.http.", 1)})

    async def no_body() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    await error_response(error)({**scope, "type": "http"}, no_body, denial_send)
