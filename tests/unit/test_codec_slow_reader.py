"""Backpressure: a client that reads slowly or not at all never makes the codec buffer without bound.

The codec pulls the next token from the backend only once the previous event's write returned, and a
write waits while the connection's buffers are full, so a silent client stalls its own generation at
what the socket buffers absorb. Past `limits.stream_send_timeout_ms` of one write waiting, the client
counts as gone: the backend stream is closed (the abort that frees the request's KV blocks) and the
request is counted as 499 `client_stopped_reading`. A client that pauses for less than that is fine.

The codec runs under a real uvicorn in a thread (real sockets, real flow control) over a fake backend
that serves an endless token stream and records when it produced its last token and when it was closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.codec.backend.protocol import GenerationRequest, TokenDelta
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig
from services.common.outputs import FinishReason
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, serve_in_thread
from tests.silent_client import open_silent_stream

pytestmark = pytest.mark.model  # the real tokenizer: the fake's fingerprint, and text to stream

SEND_TIMEOUT_MS = 1500
MAX_TOKENS = 1_000_000  # "endless": the fake streams until it is closed, or this many tokens
MIN_EVENT_SIZE = 100  # bytes of one chat chunk at least (id, model, choices, ...), for the bound below
TRANSPORT_HIGH_WATER = 64 * 1024  # asyncio's default: uvicorn's send waits above it
MEMORY_BOUND = 16 * 1024 * 1024  # peak Python allocations while stalled; 1M buffered events is ~200 MB


@dataclass
class EndlessBackend(FakeBackend):
    """Streams `num_tokens` copies of one token as fast as it is pulled (the last one finishes with
    "length"), recording how many it produced, when it produced the last, and when it was closed."""

    token_id: int = 0
    num_tokens: int = MAX_TOKENS
    num_produced: int = 0
    last_produced_s: float = 0.0
    closed_s: float | None = None

    def restart(self, num_tokens: int) -> None:
        self.reset()
        self.num_tokens, self.num_produced, self.closed_s = num_tokens, 0, None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.seen.append(request)
        try:
            for position in range(self.num_tokens):
                self.num_produced += 1
                self.last_produced_s = time.monotonic()
                finish = FinishReason.LENGTH if position == self.num_tokens - 1 else None
                yield TokenDelta(0, [self.token_id], [], finish, len(request.prompt_token_ids), 0)
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_s = time.monotonic()
            self.closed_early.append(request.request_id)
            raise
        self.completed.append(request.request_id)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> EndlessBackend:
    token_id = Tokenizer.from_dir(model_dir).encode(" one")[0]
    return EndlessBackend(
        identity_for(model_dir).tokenizer_fingerprint, max_model_len=2 * MAX_TOKENS, token_id=token_id
    )


@pytest.fixture(scope="module")
def base_url(model_dir: Path, fake: EndlessBackend) -> Iterator[str]:
    limits = LimitsConfig(
        stream_send_timeout_ms=SEND_TIMEOUT_MS,
        max_output_tokens=MAX_TOKENS,
        step_timeout_ms=1,
        request_timeout_ms=MAX_TOKENS,  # step_timeout_ms × max_output_tokens must fit in it
    )
    app = make_app(Tokenizer.from_dir(model_dir), fake, identity_for(model_dir), KvrelayConfig(limits=limits))
    with serve_in_thread(app) as url:
        yield url


CHAT_PATH = "/v1/chat/completions"


def chat_body(max_tokens: int) -> dict[str, object]:
    messages = [{"role": "user", "content": "Count forever."}]
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def max_absorbed_events(sock: socket.socket) -> int:
    """Events the buffers can hold at most, whatever the client's MSS: the server's send buffer (at
    most tcp_wmem's maximum on Linux), the client's receive buffer and uvicorn's transport buffer."""
    try:
        wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        wmem_max = 4 * 1024 * 1024
    rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return (wmem_max + rcvbuf + TRANSPORT_HIGH_WATER) // MIN_EVENT_SIZE


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_until_stalled(fake: EndlessBackend, quiet_s: float, timeout_s: float = 30.0) -> None:
    """Until the backend has not been pulled for `quiet_s`: the socket buffers are full."""
    wait_for(lambda: fake.num_produced > 0, timeout_s, "the first token")
    wait_for(lambda: time.monotonic() - fake.last_produced_s >= quiet_s, timeout_s, "the stream to stall")


def requests_counted(base_url: str, status: int) -> bool:
    metrics = httpx.get(f"{base_url}/metrics").text
    return f'kvrelay_requests_total{{protocol="chat.completions",status="{status}"}} 1.0' in metrics


def test_a_client_that_stops_reading_is_aborted_and_buffers_stay_bounded(
    base_url: str, fake: EndlessBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake.restart(MAX_TOKENS)
    caplog.set_level(logging.INFO)
    tracemalloc.start()
    try:
        with open_silent_stream(base_url, CHAT_PATH, chat_body(MAX_TOKENS)) as sock:
            wait_for(lambda: fake.closed_s is not None, 60.0, "the send timeout to close the backend stream")
            _, peak_bytes = tracemalloc.get_traced_memory()
            bound = max_absorbed_events(sock)
    finally:
        tracemalloc.stop()
    assert fake.completed == [] and fake.closed_early == [fake.seen[0].request_id]
    # Pulled only as fast as the socket took events: no queue in the codec drained the backend ahead.
    assert fake.num_produced <= min(bound, MAX_TOKENS // 10), (fake.num_produced, bound)
    assert peak_bytes < MEMORY_BOUND, peak_bytes
    # The decisive check: nothing was pulled while the last write waited, for at least the send
    # timeout (a queue between the backend and the socket would have kept pulling until the abort).
    # What ended the stream is the send timeout, not anything else: the access log and warning below.
    assert fake.closed_s is not None
    stalled_s = fake.closed_s - fake.last_produced_s
    assert stalled_s >= SEND_TIMEOUT_MS / 1000 * 0.9, stalled_s
    wait_for(lambda: requests_counted(base_url, 499), 5.0, "the 499 in the metrics")

    def access_lines() -> list[dict[str, object]]:
        return [
            r.__dict__ for r in caplog.records if r.name == "kvrelay.access" and r.__dict__["status"] != 200
        ]

    wait_for(lambda: bool(access_lines()), 5.0, "the access-log line")
    access = access_lines()
    assert [(a["status"], a["http_status"], a["outcome"]) for a in access] == [
        (499, 200, "client_stopped_reading")
    ]
    assert any(
        "client stopped reading" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )


def test_a_client_that_pauses_for_less_than_the_timeout_gets_the_whole_stream(
    base_url: str, fake: EndlessBackend
) -> None:
    num_tokens = 3000  # ~600 KB of chunks: more than the buffers absorb, so the writer stalls
    fake.restart(num_tokens)
    with open_silent_stream(base_url, CHAT_PATH, chat_body(num_tokens)) as sock:
        wait_until_stalled(fake, quiet_s=SEND_TIMEOUT_MS / 1000 / 4)
        received = bytearray()
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # then chunked encoding's end
            data = sock.recv(1 << 20)
            assert data, "the server closed the connection early"
            received += data
    assert fake.closed_early == [] and fake.completed == [fake.seen[0].request_id]
    assert fake.num_produced == num_tokens
    assert b'"finish_reason":"length"' in received


def test_a_fast_reader_is_unaffected_by_the_send_timeout(base_url: str, fake: EndlessBackend) -> None:
    num_tokens = 3000
    fake.restart(num_tokens)
    with (
        httpx.Client(base_url=base_url, timeout=30) as client,
        client.stream("POST", CHAT_PATH, json=chat_body(num_tokens)) as response,
    ):
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert fake.closed_early == [] and fake.completed == [fake.seen[0].request_id]
    assert sum('"content":" one"' in line for line in lines) == num_tokens
