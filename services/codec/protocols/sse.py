"""Server-sent events: framing, and a response that streams them with prompt abort on disconnect.

Framing: an optional `event:` line, then the payload on ONE `data:` line, then a blank line; LF only.
Each event goes out in one ASGI body message, so one write.

`EventStreamResponse` sends the 200 and its headers, then the events. While it streams it also
watches for the client going away; then it stops at once and closes the event iterator, whose
`finally` blocks abort the request behind it. An exception from the iterator after the first byte
becomes one in-band error event (formatted by the protocol), then the stream ends. Errors before
the stream starts never reach this class: the route raises them and gets a normal JSON error.

Backpressure: the next event is pulled from the iterator only after the previous write returned, and
the server's `send` waits while the connection's write buffer is over its high-water mark (uvicorn
honours the transport's pause_writing), so a slow client slows its own generation down and nothing
queues up here. A client that stops reading altogether would hold its request (and its KV blocks)
forever, so one write may wait at most `send_timeout_s`; past it the client counts as gone (499,
outcome `client_stopped_reading`) and the stream stops as on a disconnect. One watchdog task per stream
checks the write in progress (a write is the hot path: a timer per event cost the codec a third of its
per-token CPU); it notices a stalled write within 1.25 x `send_timeout_s`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from services.codec.errors import ClientStoppedReadingError, is_expected
from services.codec.metrics import StreamOutcome
from services.codec.protocols.disconnect import cancel_on_disconnect

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(payload: Mapping[str, Any]) -> str:
    """Compact JSON on one line (json.dumps escapes any newline inside strings)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def encode_event(payload: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else dumps(payload)
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()


class EventStreamResponse(Response):
    """A `text/event-stream` response over `events` (already-encoded events).

    `error_event` formats an exception raised by `events` into the protocol's in-band error event.
    `send_timeout_s` bounds each write: a client that accepts none for that long counts as gone.
    `cleanup` runs once at the end whatever happened (even if `events` never started), shielded from
    cancellation. `on_outcome` learns how the stream ended.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        request_id: str,
        error_event: Callable[[BaseException], bytes],
        send_timeout_s: float,
        cleanup: Callable[[], Awaitable[None]] | None = None,
        on_outcome: Callable[[StreamOutcome], None] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(STREAM_HEADERS)
        self._events = events
        self._request_id = request_id
        self._error_event = error_event
        self._send_timeout_s = send_timeout_s
        self._cleanup = cleanup
        self._on_outcome = on_outcome
        self._write_started: float | None = None  # monotonic start of the write in progress
        self._write_stalled = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = StreamOutcome.CLIENT_CLOSED
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await self._send_headers(send, start)
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect, receive, group.cancel_scope)
                group.start_soon(self._watch_writes, group.cancel_scope)
                outcome = await self._stream(send)
                group.cancel_scope.cancel()
            if self._write_stalled:
                raise ClientStoppedReadingError(self._send_timeout_s)
        except ClientStoppedReadingError as exc:
            outcome = self._stopped_reading(exc)
        except OSError:  # the server reports a closed connection on send (ASGI spec 2.4)
            outcome = StreamOutcome.CLIENT_CLOSED
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()
            if self._on_outcome is not None:
                self._on_outcome(outcome)

    async def _stream(self, send: Send) -> StreamOutcome:
        """Sends every event, or the in-band error; a closed connection ends it quietly."""
        outcome = StreamOutcome.COMPLETED
        try:
            while True:
                try:
                    chunk = await anext(self._events)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    outcome = StreamOutcome.FAILED
                    _log_stream_failure(exc, self._request_id)
                    await self._send_body(send, self._error_event(exc))
                    break
                await self._send_body(send, chunk)
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except ClientStoppedReadingError as exc:
            return self._stopped_reading(exc)
        except OSError:
            return StreamOutcome.CLIENT_CLOSED
        return outcome

    async def _send_body(self, send: Send, chunk: bytes) -> None:
        await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})

    async def _send_headers(self, send: Send, message: Message) -> None:
        """The first write, before the watchdog runs: its own deadline."""
        try:
            with anyio.fail_after(self._send_timeout_s):
                await send(message)
        except TimeoutError as exc:  # only our deadline: a disconnect's cancellation passes through
            raise ClientStoppedReadingError(self._send_timeout_s) from exc

    async def _send(self, send: Send, message: Message) -> None:
        """One write, timed by _watch_writes."""
        self._write_started = time.monotonic()
        try:
            await send(message)
        finally:
            self._write_started = None

    async def _watch_writes(self, scope: anyio.CancelScope) -> None:
        """Cancel the stream once one write has waited `send_timeout_s` (the client stopped reading)."""
        timeout = self._send_timeout_s
        while True:
            started = self._write_started
            left = timeout / 4 if started is None else started + timeout - time.monotonic()
            if left > 0:
                await anyio.sleep(left)
                continue
            self._write_stalled = True
            scope.cancel()
            return

    def _stopped_reading(self, exc: ClientStoppedReadingError) -> StreamOutcome:
        logger.warning("%s; stopping the stream", exc, extra={"request_id": self._request_id})
        return StreamOutcome.CLIENT_STOPPED_READING

    async def _close(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            if self._cleanup is not None:
                await self._cleanup()


def _log_stream_failure(exc: BaseException, request_id: str) -> None:
    if is_expected(exc):
        logger.warning("stream ended with %s", type(exc).__name__, extra={"request_id": request_id})
    else:
        logger.error("stream failed: %s", type(exc).__name__, exc_info=exc, extra={"request_id": request_id})
