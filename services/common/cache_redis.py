"""A local Redis of the KV cache's role, for `kvrelay up` and the tests (docs/kv-tiers.md).

The shared tier wants its own Redis, run as a cache: `allkeys-lru` under a `maxmemory`, persistence off,
and a password when one is set (KV can be turned back into prompt text). When `kv_tiers.shared_url` names
this machine (127.0.0.1, localhost, ::1) and nothing answers there, `kvrelay up` starts one with
`redis-server` from PATH and stops it with the stack; without `redis-server` it refuses, naming the fix. A
URL elsewhere is the operator's Redis, left alone.

The async lane's queue (docs/async.md) wants the opposite role: never evict (`noeviction`), every write in
the append-only file before it is acknowledged (`appendfsync always`), kept in a data directory, so a
queued job survives memory pressure and a restart. `start_queue_redis` starts one of those, the same way.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from services.common.errors import KvrelayError

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_MAXMEMORY_MB = 1024
START_TIMEOUT_S = 20.0


class CacheRedisError(KvrelayError):
    """The KV cache's Redis cannot be started here (no redis-server, or it did not come up)."""


def local_port(url: str) -> int | None:
    """The port of `url` when it names this machine over plain TCP (redis://), else None."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in LOCAL_HOSTS:
        return None
    return parts.port or 6379


def answers(port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def cache_redis_argv(server: str, port: int, maxmemory_mb: int, password: str | None) -> list[str]:
    argv = [
        server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru",
    ]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    return argv


def queue_redis_argv(server: str, port: int, data_dir: str, password: str | None) -> list[str]:
    argv = [
        server, "--port", str(port), "--bind", "127.0.0.1", "--dir", data_dir, "--save", "",
        "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    return argv


def start_cache_redis(
    port: int, maxmemory_mb: int = DEFAULT_MAXMEMORY_MB, password: str | None = None
) -> subprocess.Popen[bytes]:
    """A `redis-server` of the cache role on 127.0.0.1:`port`, once it accepts connections."""
    server = _redis_server(port, "kv_tiers.shared_url")
    return _start(cache_redis_argv(server, port, maxmemory_mb, password), port, "the KV cache's")


def start_queue_redis(port: int, data_dir: str, password: str | None = None) -> subprocess.Popen[bytes]:
    """A `redis-server` of the queue role on 127.0.0.1:`port` keeping its append-only file in
    `data_dir` (a restart there finds every acknowledged job), once it accepts connections."""
    server = _redis_server(port, "queue.url")
    return _start(queue_redis_argv(server, port, data_dir, password), port, "the queue's")


def _redis_server(port: int, setting: str) -> str:
    server = shutil.which("redis-server")
    if server is None:
        raise CacheRedisError(
            f"{setting} names 127.0.0.1:{port}, where nothing answers, and redis-server is not "
            "on PATH to start one there: install it (apt install redis-server), start a Redis there "
            f"yourself, or unset {setting}"
        )
    return server


def _start(argv: list[str], port: int, whose: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_cache_redis(proc)
            error = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
            raise CacheRedisError(f"{whose} redis-server on port {port} did not start: {error}")
        time.sleep(0.05)
    return proc


def stop_cache_redis(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def local_queue_redis(url: str | None, data_dir: Path) -> Iterator[int | None]:
    """Around a stack: start the queue Redis `url` names on this machine if nothing answers there (its
    port), keeping its append-only file in `data_dir`/queue-<port>, and stop it after; None when there is
    nothing to start. The data outlives the stack: a restart finds the jobs it had queued."""
    port = local_port(url) if url else None
    if port is None or answers(port):
        yield None
        return
    directory = data_dir / f"queue-{port}"
    directory.mkdir(parents=True, exist_ok=True)
    proc = start_queue_redis(port, str(directory))
    try:
        yield port
    finally:
        stop_cache_redis(proc)


@contextmanager
def local_cache_redis(shared_url: str | None, password: str | None) -> Iterator[int | None]:
    """Around a stack: start the cache Redis `shared_url` names on this machine if nothing answers there
    (its port), and stop it after; None when there is nothing to start."""
    port = local_port(shared_url) if shared_url else None
    if port is None or answers(port):
        yield None
        return
    proc = start_cache_redis(port, password=password)
    try:
        yield port
    finally:
        stop_cache_redis(proc)
