"""A rendered Redis container (the bundled Redis, the KV tiers' cache Redis) run here as a local redis-server:
the container's own arguments, with the password the kubelet would expand from its Secret, the TLS
Secret's volume as a local directory and a free loopback port instead of 6379; and its readiness probe run
the same way, as the kubelet runs it in the container.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.stack_helpers import free_port
from tests.tls_certs import Certs

TLS_DIR = "/etc/redis/tls"  # where the chart mounts a Redis's TLS Secret (templates/_redis.tpl)


def secret_dir(certs: Certs, directory: Path) -> Path:
    """A kubernetes.io/tls Secret with ca.crt, as its volume would hold it."""
    directory.mkdir(parents=True, exist_ok=True)
    for source, key in ((certs.cert, "tls.crt"), (certs.key, "tls.key"), (certs.ca, "ca.crt")):
        shutil.copy(source, directory / key)
    return directory


@contextmanager
def running(ctr: dict, password: str, tls_dir: Path, work_dir: Path) -> Iterator[int]:
    """`ctr`'s redis-server running until the block ends; gives its port."""
    server = shutil.which("redis-server")
    assert server is not None, "install redis-server"
    port = free_port()
    args = []
    for arg in ctr["args"]:
        arg = arg.replace("$(REDIS_PASSWORD)", password).replace(TLS_DIR, str(tls_dir))
        args.append(str(port) if arg == "6379" else arg)
    proc = subprocess.Popen(
        [server, *args, "--bind", "127.0.0.1", "--dir", str(work_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open(port):
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def readiness_probe(ctr: dict, port: int, password: str, tls_dir: Path) -> subprocess.CompletedProcess[str]:
    """`ctr`'s readiness probe (redis-cli with REDISCLI_AUTH) against the local server."""
    probe = [a.replace(TLS_DIR, str(tls_dir)) for a in ctr["readinessProbe"]["exec"]["command"]]
    return subprocess.run(
        [*probe[:-1], "-p", str(port), probe[-1]],
        env={**os.environ, "REDISCLI_AUTH": password},
        capture_output=True,
        text=True,
        timeout=10,
    )


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
