"""What every kvrelay process says about itself (docs/observability.md "Process and memory"), for leak and
exhaustion alerts and the soak's verdicts:

- prometheus_client's process collector under the `kvrelay` namespace:
  `kvrelay_process_resident_memory_bytes`, `kvrelay_process_virtual_memory_bytes`,
  `kvrelay_process_open_fds`, `kvrelay_process_max_fds`, `kvrelay_process_cpu_seconds_total`,
  `kvrelay_process_start_time_seconds` (prefixed, so a rule selects kvrelay's processes without knowing
  the scrape job's name);
- `kvrelay_process_threads`: every thread the kernel counts, native ones (gRPC's, torch's, the C
  kernels') included;
- `kvrelay_connections{listener}` (where a listener is registered): the TCP connections established to
  the process's listening ports, counted from /proc, whatever protocol they carry (HTTP, WebSocket, gRPC).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

NAMESPACE = "kvrelay"
ESTABLISHED = "01"  # /proc/net/tcp's state column


def register_process_metrics(registry: CollectorRegistry) -> None:
    ProcessCollector(namespace=NAMESPACE, registry=registry)
    threads = Gauge(
        "kvrelay_process_threads", "Threads of this process, native ones included.", registry=registry
    )
    threads.set_function(thread_count)


def thread_count() -> int:
    """Every thread of this process as the kernel counts them; Python's own where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return threading.active_count()


class ConnectionsCollector(Collector):
    """`kvrelay_connections{listener}`: established TCP connections to each named listening port."""

    def __init__(self, listeners: Mapping[str, int]) -> None:
        self.listeners = dict(listeners)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvrelay_connections",
            "TCP connections established to this process's listening ports, by listener.",
            labels=["listener"],
        )
        counts = established_connections(set(self.listeners.values()))
        for name, port in sorted(self.listeners.items()):
            family.add_metric([name], counts.get(port, 0))
        yield family


def established_connections(ports: set[int]) -> dict[int, int]:
    """Established TCP connections whose local port is one of `ports` and whose socket this process
    holds (IPv4 and IPv6), by port. Empty where /proc is absent."""
    owned = _socket_inodes()
    counts: dict[int, int] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != ESTABLISHED or fields[9] not in owned:
                continue
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if port in ports:
                counts[port] = counts.get(port, 0) + 1
    return counts


def _socket_inodes() -> set[str]:
    inodes: set[str] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes
