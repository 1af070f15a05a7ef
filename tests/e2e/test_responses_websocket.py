"""The Responses WebSocket transport on the real stack (worker, router and codec processes, the real
model) with the `websockets` client: a greedy response's events equal the SSE stream's event for event
and validate against the Open Responses schemas; a `store: false` continuation on one socket; closing
the socket mid-stream aborts the request on the worker and frees its KV blocks; the codec's metrics
count the connection and its responses."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from tests.e2e.conftest import RunningStack, worker_load
from tests.openresponses_schemas import validate_stream_event

pytestmark = [pytest.mark.model]

RECV_TIMEOUT_S = 60.0
DEADLINE_S = 60.0


def ws_url(stack: RunningStack) -> str:
    return stack.base_url.replace("http://", "ws://") + "/v1/responses"


def model_of(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"])


def turn(ws: ClientConnection) -> list[dict[str, Any]]:
    events = []
    while True:
        message = ws.recv(timeout=RECV_TIMEOUT_S)
        assert isinstance(message, str)
        event = json.loads(message)
        events.append(event)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events


def blanked(value: Any) -> Any:
    """IDs, clocks and cached_tokens blanked: they differ between two responses to the same request (the
    second finds the first's prompt in the prefix cache)."""
    if isinstance(value, dict):
        return {
            key: "*"
            if key in ("id", "item_id", "created_at", "completed_at", "cached_tokens")
            else blanked(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [blanked(item) for item in value]
    return value


def test_websocket_events_equal_sse_events_for_a_greedy_request(stack: RunningStack) -> None:
    body = {
        "model": model_of(stack),
        "input": "Name three colors.",
        "temperature": 0,
        "max_output_tokens": 24,
        "store": False,
    }
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json={**body, "stream": True}) as response:
        sse = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    with connect(ws_url(stack)) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        frames = turn(ws)
    assert len(frames) > 5
    assert [blanked(event) for event in frames] == [blanked(event) for event in sse]
    for event in frames:
        validate_stream_event(event)


def test_store_false_continuation_on_one_socket(stack: RunningStack) -> None:
    model = model_of(stack)
    with connect(ws_url(stack)) as ws:
        ws.send(
            json.dumps({"type": "response.create", "model": model, "store": False, "input": "Hi, I am Ada."})
        )
        first = turn(ws)[-1]["response"]
        follow_up = {"type": "response.create", "model": model, "store": False, "input": "Who am I?"}
        ws.send(json.dumps({**follow_up, "previous_response_id": first["id"], "max_output_tokens": 16}))
        second = turn(ws)[-1]
    assert second["type"] in ("response.completed", "response.incomplete")
    # The continuation's prompt held the first turn (input and answer): more input tokens than either.
    assert second["response"]["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    # Not stored: plain HTTP cannot continue from it.
    refused = httpx.post(
        f"{stack.base_url}/v1/responses",
        json={"model": model, "input": "Again", "previous_response_id": first["id"]},
    )
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "previous_response_not_found"


def test_closing_mid_stream_aborts_the_request_and_frees_its_blocks(stack: RunningStack) -> None:
    before = worker_load(stack)
    assert before.running == 0
    body = {
        "type": "response.create",
        "model": model_of(stack),
        "input": "Write a very long story about a dragon.",
        "max_output_tokens": 1000,
        "store": False,
    }
    with connect(ws_url(stack)) as ws:
        ws.send(json.dumps(body))
        while json.loads(ws.recv(timeout=RECV_TIMEOUT_S))["type"] != "response.output_text.delta":
            pass
        assert worker_load(stack).running == 1  # the stream is known to be on the worker
    deadline = time.monotonic() + DEADLINE_S

    def is_aborted() -> bool:
        load = worker_load(stack)
        return load.requests_aborted_total > before.requests_aborted_total and (
            load.running == load.waiting == load.kv_blocks.active == 0
        )

    while not is_aborted():
        assert time.monotonic() < deadline, "the request was not aborted, or its blocks not freed"
        time.sleep(0.05)
    after = worker_load(stack)
    assert after.generation_tokens_total - before.generation_tokens_total < 1000  # stopped early
    metrics = httpx.get(f"{stack.base_url}/metrics").text
    assert "kvrelay_codec_websocket_connections 0.0" in metrics
    assert "kvrelay_codec_websocket_responses_per_connection_count" in metrics
