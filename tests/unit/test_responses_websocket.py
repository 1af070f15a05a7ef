"""The Responses WebSocket transport (protocols/openai_responses_ws.py) on a real uvicorn server with the
`websockets` client, the backend faked at its seam: turns, ordering, the queue bound, continuation with
`store: false`, eviction, the lifetime limit, bad frames, refused upgrades and drain on shutdown.
The real stack's version (the real model, KV freed on close) is tests/e2e/test_responses_websocket.py."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from services.codec.server import CodecServer, websocket_settings
from services.codec.text.tokenizer import Tokenizer
from services.common.config import (
    AuthConfig,
    KvrelayConfig,
    LimitsConfig,
    ResponsesConfig,
    ServerConfig,
    WebSocketConfig,
)
from tests.codec_fakes import MODEL_NAME, FakeBackend, free_port, identity_for, make_app, scripted
from tests.openresponses_schemas import validate, validate_stream_event
from tests.silent_client import MSS_BYTES, RCVBUF_BYTES
from tests.unit.test_codec_auth import add_key

TEXT = "Hello there, friend."
RECV_TIMEOUT_S = 20.0


class Served:
    def __init__(self, url: str, backend: FakeBackend, server: CodecServer) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://") + "/v1/responses"
        self.backend = backend
        self.server = server


def serve(
    tokenizer: Tokenizer,
    model_dir: Path,
    websocket: WebSocketConfig | None = None,
    config: KvrelayConfig | None = None,
) -> Iterator[Served]:
    """The codec app under CodecServer (the real server class, with its WebSocket settings and drain)."""
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode(TEXT)])
    ws_config = websocket or WebSocketConfig()
    config = (config or KvrelayConfig()).model_copy(
        update={"responses": ResponsesConfig(websocket=ws_config)}
    )
    app = make_app(tokenizer, backend, identity_for(model_dir), config)
    port = free_port()
    server_config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        **websocket_settings(ws_config),
    )
    server = CodecServer(server_config, None, grace_s=10)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", backend, server)
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture
def served(tokenizer: Tokenizer, model_dir: Path) -> Iterator[Served]:
    yield from serve(tokenizer, model_dir)


def create(**fields: Any) -> str:
    return json.dumps({"type": "response.create", "model": MODEL_NAME, "input": "Hi", **fields})


def recv(ws: ClientConnection) -> dict[str, Any]:
    message = ws.recv(timeout=RECV_TIMEOUT_S)
    assert isinstance(message, str), "every server frame is JSON text"
    event = json.loads(message)
    assert isinstance(event, dict)
    return event


def turn(ws: ClientConnection) -> list[dict[str, Any]]:
    """The events of one response, up to its terminal event or an error envelope."""
    events = []
    while True:
        event = recv(ws)
        events.append(event)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
            return events
        if event["type"] == "error" and "status" in event:
            return events


def terminal(events: list[dict[str, Any]]) -> dict[str, Any]:
    return events[-1]


def test_one_response_streams_the_sse_events_and_validates(served: Served) -> None:
    with connect(served.ws_url) as ws:
        ws.send(create(store=False))
        events = turn(ws)
    types = [event["type"] for event in events]
    assert types[:2] == ["response.created", "response.in_progress"], events
    assert types[-1] == "response.completed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = terminal(events)["response"]
    assert final["output"][0]["content"][0]["text"] == TEXT
    for event in events:
        validate_stream_event(event)


def test_websocket_events_equal_sse_events_for_the_same_request(served: Served) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "temperature": 0, "store": False}
    with httpx.stream("POST", f"{served.url}/v1/responses", json={**body, "stream": True}) as response:
        sse = [
            json.loads(line[len("data: ") :])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    with connect(served.ws_url) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        frames = turn(ws)
    assert [event["type"] for event in frames] == [event["type"] for event in sse]
    assert [_without_ids(event) for event in frames] == [_without_ids(event) for event in sse]


def _without_ids(value: Any) -> Any:
    """The event with the per-response IDs and clocks blanked (they differ between two responses)."""
    if isinstance(value, dict):
        return {
            key: "*" if key in ("id", "item_id", "created_at", "completed_at") else _without_ids(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    return value


def test_three_sequential_responses_and_queued_creates_run_in_order(served: Served) -> None:
    with connect(served.ws_url) as ws:
        for _ in range(3):
            ws.send(create(store=False))
            assert terminal(turn(ws))["type"] == "response.completed"
        ws.send(create(store=False, metadata={"n": "1"}))
        ws.send(create(store=False, metadata={"n": "2"}))
        ws.send(create(store=False, metadata={"n": "3"}))
        finals = [terminal(turn(ws))["response"] for _ in range(3)]
    assert [final["metadata"]["n"] for final in finals] == ["1", "2", "3"]
    assert len(served.backend.seen) == 6


def test_creates_past_the_queue_bound_get_the_error(tokenizer: Tokenizer, model_dir: Path) -> None:
    for served in serve(tokenizer, model_dir, WebSocketConfig(max_queued=1)):
        served.backend.stall_before = 2  # the first response holds until its stream is closed
        with connect(served.ws_url) as ws:
            ws.send(create(store=False))
            assert recv(ws)["type"] == "response.created"
            ws.send(create(store=False))  # queued
            ws.send(create(store=False))  # past the bound
            while (event := recv(ws))["type"] != "error":
                pass
            validate("WebSocketErrorEvent", event)
            assert event["status"] == 429
            assert event["error"]["code"] == "too_many_queued_responses"


def test_store_false_continues_on_the_socket_not_after_a_reconnect(served: Served) -> None:
    with connect(served.ws_url) as ws:
        ws.send(create(store=False, input="My name is Ada."))
        first = terminal(turn(ws))["response"]
        ws.send(create(store=False, previous_response_id=first["id"], input="What is my name?"))
        second = terminal(turn(ws))
    assert second["type"] == "response.completed"
    prompt = served.backend.seen[-1].prompt_token_ids
    assert len(prompt) > len(served.backend.seen[0].prompt_token_ids)  # the first turn is in it
    with connect(served.ws_url) as ws:
        ws.send(create(store=False, previous_response_id=first["id"], input="And now?"))
        [error] = turn(ws)
    validate("WebSocketErrorEvent", error)
    assert error["error"]["code"] == "previous_response_not_found"
    assert error["error"]["param"] == "previous_response_id"


def test_unknown_previous_response_id_is_not_found(served: Served) -> None:
    with connect(served.ws_url) as ws:
        ws.send(create(previous_response_id="resp_nope"))
        [error] = turn(ws)
        assert error["error"]["code"] == "previous_response_not_found"
        ws.send(create(store=False))  # the socket still serves
        assert terminal(turn(ws))["type"] == "response.completed"


def test_a_failed_continuation_evicts_what_it_continued_from(served: Served) -> None:
    with connect(served.ws_url) as ws:
        ws.send(create(store=False))
        first = terminal(turn(ws))["response"]
        bad_output = [{"type": "function_call_output", "call_id": "call_unknown", "output": "42"}]
        ws.send(create(store=False, previous_response_id=first["id"], input=bad_output))
        [error] = turn(ws)
        assert error["status"] == 400
        assert error["error"]["param"] == "input[0].call_id"
        ws.send(create(store=False, previous_response_id=first["id"], input="Again"))
        [evicted] = turn(ws)
    assert evicted["error"]["code"] == "previous_response_not_found"


def test_the_lifetime_limit_ends_the_connection(tokenizer: Tokenizer, model_dir: Path) -> None:
    for served in serve(tokenizer, model_dir, WebSocketConfig(max_lifetime_s=1.0)):
        with connect(served.ws_url) as ws:
            error = recv(ws)  # nothing sent: the limit comes on its own
            validate("WebSocketErrorEvent", error)
            assert error["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=RECV_TIMEOUT_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        ('{"type": "session.update"}', "unknown_event_type"),
    ],
)
def test_bad_text_frames_get_an_error_and_the_socket_serves_on(served: Served, frame: str, code: str) -> None:
    with connect(served.ws_url) as ws:
        ws.send(frame)
        error = recv(ws)
        validate("WebSocketErrorEvent", error)
        assert (error["status"], error["error"]["code"]) == (400, code)
        ws.send(create(store=False))
        assert terminal(turn(ws))["type"] == "response.completed"


@pytest.mark.parametrize("field", ["stream", "stream_options", "background"])
def test_http_only_fields_are_refused(served: Served, field: str) -> None:
    with connect(served.ws_url) as ws:
        ws.send(create(**{field: False if field != "stream_options" else {}}))
        [error] = turn(ws)
    assert (error["status"], error["error"]["param"]) == (400, field)
    assert served.backend.seen == []


def test_a_binary_frame_is_an_error_then_close_1003(served: Served) -> None:
    with connect(served.ws_url) as ws:
        ws.send(b"\x00\x01")
        error = recv(ws)
        assert error["error"]["code"] == "unsupported_frame"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=RECV_TIMEOUT_S)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003


def test_an_oversize_frame_closes_with_1009_and_others_are_unaffected(
    tokenizer: Tokenizer, model_dir: Path
) -> None:
    for served in serve(tokenizer, model_dir, WebSocketConfig(max_frame_bytes=4096)):
        with connect(served.ws_url) as other, connect(served.ws_url) as ws:
            ws.send(create(input="x" * 8192))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=RECV_TIMEOUT_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
            other.send(create(store=False))
            assert terminal(turn(other))["type"] == "response.completed"
        assert served.backend.seen and all(len(r.prompt_token_ids) < 100 for r in served.backend.seen)


def test_closing_mid_stream_aborts_the_generation(served: Served) -> None:
    served.backend.stall_before = 3
    with connect(served.ws_url) as ws:
        ws.send(create(store=False))
        while recv(ws)["type"] != "response.output_text.delta":
            pass
    deadline = time.monotonic() + RECV_TIMEOUT_S
    while not served.backend.closed_early:
        assert time.monotonic() < deadline, "the generation was not aborted"
        time.sleep(0.02)
    assert served.backend.completed == []


def test_shutdown_finishes_the_response_in_flight_then_errors_and_closes_1001(
    tokenizer: Tokenizer, model_dir: Path
) -> None:
    for served in serve(tokenizer, model_dir):
        served.backend.delay_s = 0.05
        with connect(served.ws_url) as busy, connect(served.ws_url) as idle:
            busy.send(create(store=False))
            assert recv(busy)["type"] == "response.created"
            served.server.should_exit = True  # what SIGTERM does
            assert terminal(turn(busy))["type"] == "response.completed"
            for ws in (busy, idle):
                error = recv(ws)
                validate("WebSocketErrorEvent", error)
                assert (error["status"], error["error"]["code"]) == (503, "server_shutting_down")
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=RECV_TIMEOUT_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        assert len(served.backend.completed) == 1


def test_an_upgrade_needs_a_key_like_any_request(
    tokenizer: Tokenizer, model_dir: Path, tmp_path: Path
) -> None:
    keys_path = tmp_path / "keys.yaml"
    _, key = add_key(keys_path, "acme")
    config = KvrelayConfig(auth=AuthConfig(keys_file=str(keys_path)))
    for served in serve(tokenizer, model_dir, config=config):
        with pytest.raises(InvalidStatus) as refused:
            connect(served.ws_url).close()
        assert refused.value.response.status_code == 401
        assert "no API key" in json.loads(refused.value.response.body)["error"]["message"]
        with pytest.raises(InvalidStatus):
            connect(served.ws_url, additional_headers={"Authorization": "Bearer kvr-nope-nope"}).close()
        with connect(served.ws_url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            ws.send(create(store=False))
            assert terminal(turn(ws))["type"] == "response.completed"
        assert len(served.backend.seen) == 1


def test_open_sockets_count_against_the_connection_limit(tokenizer: Tokenizer, model_dir: Path) -> None:
    config = KvrelayConfig(server=ServerConfig(max_connections=2))
    for served in serve(tokenizer, model_dir, config=config):
        with connect(served.ws_url), connect(served.ws_url):
            with pytest.raises(InvalidStatus) as refused:
                connect(served.ws_url).close()
            assert refused.value.response.status_code == 503
        with connect(served.ws_url) as ws:  # the two closed: room again
            ws.send(create(store=False))
            assert terminal(turn(ws))["type"] == "response.completed"


def test_a_client_that_stops_reading_is_aborted_and_others_are_unaffected(
    tokenizer: Tokenizer, model_dir: Path
) -> None:
    config = KvrelayConfig(limits=LimitsConfig(stream_send_timeout_ms=300))
    for served in serve(tokenizer, model_dir, config=config):
        served.backend.script = scripted([tokenizer.encode(" dragon") * 1000], "length")
        silent = open_silent_websocket(served.ws_url, create(store=False, max_output_tokens=1000))
        try:
            deadline = time.monotonic() + 60
            while not served.backend.closed_early:
                assert time.monotonic() < deadline, (
                    f"the silent client's generation was never aborted (started: {len(served.backend.seen)})"
                )
                time.sleep(0.05)
            assert served.backend.completed == []
            served.backend.script = scripted([tokenizer.encode(TEXT)])
            with connect(served.ws_url) as ws:
                ws.send(create(store=False))
                assert terminal(turn(ws))["type"] == "response.completed"
        finally:
            silent.close()


def open_silent_websocket(ws_url: str, text: str) -> socket.socket:
    """A WebSocket client with small buffers that sends one text frame and then reads nothing."""
    address = urlsplit(ws_url)
    assert address.hostname is not None and address.port is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS_BYTES)
    sock.connect((address.hostname, address.port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET {address.path} HTTP/1.1\r\nHost: {address.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
    length = len(payload)
    size = bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + length.to_bytes(2, "big")
    sock.sendall(b"\x81" + size + mask + masked)
    return sock
