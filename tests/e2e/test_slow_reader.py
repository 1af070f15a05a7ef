"""A client that stops reading a stream, on the real stack: once one write waited past
`limits.stream_send_timeout_ms`, the codec counts the client as gone, the request is aborted on the
worker and its KV blocks are freed, before the request would have finished on its own.

Loopback makes this easy to get wrong: the kernel absorbs megabytes for a silent client (it autotunes
the server's send buffer from loopback's 64 KiB MSS), more than a few thousand small chunks, so the
request could finish before any write blocks and the test would prove nothing. Hence:
1. the silent client caps its MSS and its receive buffer before connecting (tests/silent_client.py),
   which keeps the connection's buffers to tens of KiB beside uvicorn's 64 KiB transport buffer;
2. each event is fat (20 top logprobs, over 1 KB), so those buffers fill within some 100 tokens;
3. the assertions rest on counts, not on timing: the codec's access log must say 499
   `client_stopped_reading`, and the worker must count exactly one more aborted request, fewer tokens
   generated than asked for, and no running request or active KV block left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import RunningStack, start_stack, worker_load
from tests.silent_client import open_silent_stream

pytestmark = [pytest.mark.model, pytest.mark.slow]

SEND_TIMEOUT_MS = 1000
MAX_TOKENS = 3000
STEP_TIMEOUT_MS = 2000  # the default; the request timeout must cover it × max_output_tokens
ABORT_DEADLINE_S = 120.0  # a generous bound on the whole wait; nothing asserts how fast it went
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def slow_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(
        model_dir,
        tmp_path_factory.mktemp("slow-reader-logs"),
        KVRELAY_LIMITS__STREAM_SEND_TIMEOUT_MS=str(SEND_TIMEOUT_MS),
        KVRELAY_LIMITS__MAX_OUTPUT_TOKENS=str(MAX_TOKENS),
        KVRELAY_LIMITS__REQUEST_TIMEOUT_MS=str(STEP_TIMEOUT_MS * MAX_TOKENS),
    )
    yield running
    for proc in reversed(running.procs):
        proc.stop()


def chat_body(model: str, max_tokens: int, *, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": stream,
    }


def access_lines(stack: RunningStack) -> list[dict[str, Any]]:
    """The codec's access-log lines (its log is JSON lines)."""
    lines = []
    for text in stack.procs[-1].log().splitlines():
        if text.startswith("{"):
            entry = json.loads(text)
            if entry.get("logger") == "kvrelay.access" and entry.get("route") == CHAT_PATH:
                lines.append(entry)
    return lines


def poll(condition: Any, deadline: float, what: str) -> float:
    """Polls `condition` until it holds; returns the time it did. Fails at `deadline` (monotonic)."""
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic()


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(slow_stack: RunningStack) -> None:
    model = httpx.get(f"{slow_stack.base_url}/v1/models").json()["data"][0]["id"]
    before = worker_load(slow_stack)
    assert before.running == 0
    started = time.monotonic()
    deadline = started + ABORT_DEADLINE_S
    with open_silent_stream(slow_stack.base_url, CHAT_PATH, chat_body(model, MAX_TOKENS, stream=True)):
        poll(lambda: worker_load(slow_stack).running == 1, deadline, "the request to run")

        def is_aborted() -> bool:
            load = worker_load(slow_stack)
            return load.requests_aborted_total > before.requests_aborted_total and (
                load.running == load.waiting == load.kv_blocks.active == 0
            )

        freed_s = poll(is_aborted, deadline, "the request to be aborted and its blocks freed") - started
        poll(lambda: len(access_lines(slow_stack)) == 1, deadline, "the access-log line")
    assert freed_s >= SEND_TIMEOUT_MS / 1000  # one write waited the whole send timeout first
    after = worker_load(slow_stack)
    assert after.requests_aborted_total == before.requests_aborted_total + 1
    num_generated = after.generation_tokens_total - before.generation_tokens_total
    line = access_lines(slow_stack)[-1]
    assert (line["status"], line["http_status"], line["outcome"]) == (499, 200, "client_stopped_reading")
    # Cut off: the worker stopped short of the tokens asked for, having made at least those the codec
    # counted as it streamed them.
    assert 0 < line["completion_tokens"] <= num_generated < MAX_TOKENS, (line, num_generated)
    assert "client stopped reading" in slow_stack.procs[-1].log()
