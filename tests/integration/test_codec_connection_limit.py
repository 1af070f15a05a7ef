"""The codec's HTTP connection limit (server.max_connections, issue 22) on a real codec process: with the
limit held by idle connections, a new request gets a 503 at once (no work, no queue), and the codec serves
again as soon as they close."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.stack_helpers import Proc, free_port, stack_env, wait_until

pytestmark = pytest.mark.model

LIMIT = 3


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_connections_past_the_limit_get_a_503_until_some_close(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = stack_env("connection-limit-token", KVRELAY_SERVER__MAX_CONNECTIONS=str(LIMIT))
    args = ["codec", "--model", str(model_dir), "--router", f"127.0.0.1:{free_port()}", "--port", str(port)]
    codec = Proc(args, env, tmp_path / "codec.log")
    url = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        wait_until(lambda: _health(url) == 200 or codec.popen.poll() is not None, 60.0, "the codec serves")
        assert codec.popen.poll() is None, codec.log()[-2000:]
        for _ in range(LIMIT):  # connections that never finish their request line
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            held.append(conn)
        wait_until(lambda: _health(url) == 503, 10.0, "a request past the limit is refused")
        for conn in held:
            conn.close()
        held.clear()
        wait_until(lambda: _health(url) == 200, 10.0, "the codec serves again once connections close")
    finally:
        for conn in held:
            conn.close()
        codec.stop()
