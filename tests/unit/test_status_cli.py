"""`kvrelay status` against a stand-in /status endpoint, and against nothing at all."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.cli import status
from services.common.local_stack import free_ports

DOCUMENT = {
    "services": [
        {"name": "codec", "role": "codec", "address": "127.0.0.1:8000", "ready": True, "running": 1,
         "waiting": 0, "requests_total": 7},
        {"name": "worker-0", "role": "worker", "address": "127.0.0.1:8002", "ready": False, "running": 2,
         "waiting": 3, "requests_total": 12,
         "kv_blocks": {"total": 100, "active": 10, "cached": 5, "free": 85},
         "prefix_cache": {"queries": 12, "hits": 4}, "weights": "gguf-hybrid", "small_step_max_tokens": 12,
         "weight_bytes": 365_000_000, "steps_by_path": {"kernels": 40, "gemm": 3},
         "kv_tiers": [
             {"name": "disk", "up": True, "hits": 3, "misses": 1, "used_bytes": 12 * 2**20},
             {"name": "shared", "up": False, "hits": 0, "misses": 2, "used_bytes": -1},
         ]},
        {"name": "worker-1", "role": "prefill", "address": "127.0.0.1:8003", "ready": True, "running": 0,
         "waiting": 0, "requests_total": 0, "kv_transfer_bytes_total": 4096, "remote_prefills_total": 2,
         "prefill_fallbacks_total": 0},
        {"name": "worker-2", "role": "decode", "address": "127.0.0.1:8004", "ready": True, "running": 1,
         "waiting": 0, "requests_total": 3, "kv_transfer_bytes_total": 4096, "remote_prefills_total": 2,
         "prefill_fallbacks_total": 1},
    ]
}  # fmt: skip


class _StatusHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(DOCUMENT).encode() if self.path == "/status" else b"{}"
        self.send_response(200 if self.path == "/status" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stack_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    status.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["status", *argv])
    code: int = args.handler(args)
    return code


def test_json_prints_the_status_document(stack_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--json", "--url", stack_url]) == 0
    assert json.loads(capsys.readouterr().out) == DOCUMENT


def test_table_has_a_row_per_service_and_dashes_for_missing_fields(
    stack_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(status.URL_ENV, stack_url)
    assert run([]) == 0
    header, codec, worker, prefill, decode = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["NAME", "ROLE", "ADDRESS"]
    assert header.split()[-7:] == [
        "BYTES",
        "REMOTE/FALLBACKS",
        "WEIGHTS",
        "STEPS",
        "KERNELS/GEMM",
        "KV",
        "TIERS",
    ]
    assert codec.split() == [
        "codec",
        "codec",
        "127.0.0.1:8000",
        "yes",
        "1",
        "0",
        "7",
        "-/-/-/-",
        "-/-",
        "-",
        "-/-",
        "-",
        "-",
        "-",
    ]
    assert worker.split() == [
        "worker-0",
        "worker",
        "127.0.0.1:8002",
        "no",
        "2",
        "3",
        "12",
        "10/5/85/100",
        "4/12",
        "-",
        "-/-",
        "gguf-hybrid(<=12,348MB)",
        "40/3",
        "disk:up,3/1,12MB",
        "shared:DOWN,0/2",
    ]
    assert prefill.split()[:2] == ["worker-1", "prefill"] and prefill.split()[-5:-3] == ["4096", "2/0"]
    assert decode.split()[:2] == ["worker-2", "decode"] and decode.split()[-5:-3] == ["4096", "2/1"]


def test_a_stack_that_does_not_answer_is_one_line_and_exit_code_1(capsys: pytest.CaptureFixture[str]) -> None:
    (port,) = free_ports(1)
    assert run(["--url", f"http://127.0.0.1:{port}"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and f"no kvrelay stack answers at http://127.0.0.1:{port}" in lines[0]


def test_an_http_error_from_the_stack_is_reported(stack_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--url", stack_url + "/elsewhere"]) == 1
    assert "HTTP 404" in capsys.readouterr().err
