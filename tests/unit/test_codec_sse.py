"""SSE framing and EventStreamResponse at the ASGI level: one message per event, in-band errors,
cleanup, and stopping at once when the client disconnects."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from starlette.types import Message

from services.codec.metrics import StreamOutcome
from services.codec.protocols.sse import DONE, EventStreamResponse, encode_event


def test_event_is_one_data_line_with_lf_framing() -> None:
    assert encode_event({"a": "x\ny", "b": "é"}) == 'data: {"a":"x\\ny","b":"é"}\n\n'.encode()
    assert encode_event({"type": "ping"}, event="ping") == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert encode_event("[DONE]") == DONE


class Harness:
    """Drives an ASGI response by hand: records every sent message; `disconnect` ends `receive`."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.disconnect = anyio.Event()
        self.outcomes: list[StreamOutcome] = []
        self.cleaned = 0

    async def receive(self) -> Message:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def cleanup(self) -> None:
        self.cleaned += 1

    def response(self, events: AsyncIterator[bytes]) -> EventStreamResponse:
        return EventStreamResponse(
            events,
            request_id="req_t",
            error_event=lambda exc: encode_event({"error": {"message": str(exc)}}),
            send_timeout_s=5.0,
            cleanup=self.cleanup,
            on_outcome=self.outcomes.append,
        )

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def run(harness: Harness, events: AsyncIterator[bytes]) -> None:
    await harness.response(events)({"type": "http"}, harness.receive, harness.send)


async def test_each_event_is_one_body_message_with_stream_headers() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield encode_event({"n": 1})
        yield DONE

    harness = Harness()
    await run(harness, events())
    headers = dict(harness.sent[0]["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert (headers[b"cache-control"], headers[b"x-accel-buffering"]) == (b"no-cache", b"no")
    assert harness.bodies() == [b'data: {"n":1}\n\n', DONE, b""]
    assert (harness.outcomes, harness.cleaned) == ([StreamOutcome.COMPLETED], 1)


async def test_failure_after_the_first_byte_is_one_error_event_then_the_end() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield encode_event({"n": 1})
        raise RuntimeError("boom")

    harness = Harness()
    await run(harness, events())
    assert harness.bodies() == [b'data: {"n":1}\n\n', b'data: {"error":{"message":"boom"}}\n\n', b""]
    assert harness.outcomes == [StreamOutcome.FAILED]


async def test_disconnect_stops_a_waiting_stream_and_closes_it() -> None:
    closed: list[bool] = []
    waiting = anyio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield encode_event({"n": 1})
            waiting.set()
            await anyio.sleep_forever()  # waiting on the backend for a next token that never comes
            yield encode_event({"n": 2})
        finally:
            closed.append(True)

    harness = Harness()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(run, harness, events())
            await waiting.wait()  # the first event was sent; the stream waits for the next
            harness.disconnect.set()
    assert harness.bodies() == [b'data: {"n":1}\n\n']
    assert closed == [True]
    assert (harness.outcomes, harness.cleaned) == ([StreamOutcome.CLIENT_CLOSED], 1)


@pytest.mark.parametrize("error", [OSError("gone"), ConnectionResetError("reset")])
async def test_a_send_that_fails_ends_the_stream_as_client_closed(error: OSError) -> None:
    async def events() -> AsyncIterator[bytes]:
        yield encode_event({"n": 1})

    harness = Harness()

    async def failing_send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise error
        harness.sent.append(message)

    await harness.response(events())({"type": "http"}, harness.receive, failing_send)
    assert (harness.outcomes, harness.cleaned) == ([StreamOutcome.CLIENT_CLOSED], 1)


async def test_a_write_that_waits_past_the_send_timeout_stops_the_stream_and_pulls_no_more() -> None:
    num_pulled = 0
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        nonlocal num_pulled
        try:
            while True:  # endless: only the consumer's pace bounds it
                num_pulled += 1
                yield encode_event({"n": num_pulled})
        finally:
            closed.append(True)

    harness = Harness()

    async def stalling_send(message: Message) -> None:
        harness.sent.append(message)
        if len(harness.bodies()) == 3:
            await anyio.sleep_forever()  # the client stopped reading: the write never completes

    response = EventStreamResponse(
        events(),
        request_id="req_t",
        error_event=lambda exc: b"",
        send_timeout_s=0.05,
        cleanup=harness.cleanup,
        on_outcome=harness.outcomes.append,
    )
    with anyio.fail_after(5):
        await response({"type": "http"}, harness.receive, stalling_send)
    assert num_pulled == 3 and closed == [True]
    assert (harness.outcomes, harness.cleaned) == ([StreamOutcome.CLIENT_STOPPED_READING], 1)
