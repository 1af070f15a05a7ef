"""Free loopback ports for the services a test starts, safe when several pytest workers run at once.

A port the kernel hands out for `bind(port 0)` comes from the ephemeral range (32768-60999 on Linux), the
same range every outgoing connection takes its source port from. Between the moment a test learns such a
port and the moment its child process binds it, a client socket of the other worker (or of this one) may
take it. So a test's ports come from below that range instead, 20000-32767, and each pytest-xdist worker
draws from its own slice of it (`PYTEST_XDIST_WORKER` gw0, gw1, ...): two workers can never pick the same
port, and no outgoing connection ever sits on one. Within a worker the ports go round the slice from a
random start, so two calls never return the same port until the slice has been used up once.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator

FIRST_PORT = 20000
END_PORT = 32768  # Linux's ephemeral range starts here


def worker_slice() -> range:
    """The ports this pytest process may hand out: all of them alone, its own share under xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return range(FIRST_PORT, END_PORT)
    index = int(worker[2:])
    size = (END_PORT - FIRST_PORT) // count
    return range(FIRST_PORT + index * size, FIRST_PORT + (index + 1) * size)


def _ports_round(ports: range) -> Iterator[int]:
    start = random.randrange(len(ports))
    for offset in itertools.cycle(range(len(ports))):
        yield ports[(start + offset) % len(ports)]


_NEXT = _ports_round(worker_slice())


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(num_ports: int) -> int:
    """The first of `num_ports` consecutive free ports in this worker's slice."""
    ports = worker_slice()
    for _ in range(len(ports)):
        base = next(_NEXT)
        if base + num_ports <= ports.stop and all(is_free(port) for port in range(base, base + num_ports)):
            for _ in range(num_ports - 1):  # the run is handed out: the round moves past it
                next(_NEXT)
            return base
    raise RuntimeError(f"no run of {num_ports} free ports in {ports.start}-{ports.stop - 1}")


def free_port() -> int:
    """A free port in this worker's slice."""
    return free_port_run(1)
