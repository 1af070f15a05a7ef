"""Process and memory signals (services/common/process_metrics.py, the worker's GPU memory collector):
every service's registry carries the process's resident memory, file descriptors and threads; the
connection gauge counts real TCP connections to a listening port as they open and close; a GPU worker's
registry reports its device's memory by kind."""

from __future__ import annotations

import socket
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.process_metrics import (
    ConnectionsCollector,
    established_connections,
    register_process_metrics,
    thread_count,
)
from services.worker.metrics import WorkerMetrics
from tests.engine_fakes import StubGpu
from tests.stack_helpers import wait_for


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_registry_carries_the_process_memory_fds_and_threads() -> None:
    registry = CollectorRegistry()
    register_process_metrics(registry)
    before = samples(registry)[("kvrelay_process_threads", ())]
    assert samples(registry)[("kvrelay_process_resident_memory_bytes", ())] > 10 << 20
    fds = samples(registry)[("kvrelay_process_open_fds", ())]
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    with open(__file__, "rb"):
        grown = samples(registry)
        assert grown[("kvrelay_process_open_fds", ())] >= fds + 1
        assert grown[("kvrelay_process_threads", ())] >= before + 1
    stop.set()
    worker.join()
    assert thread_count() >= 1


def test_the_connection_gauge_follows_real_connections() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    registry = CollectorRegistry()
    registry.register(ConnectionsCollector({"http": port}))

    def count() -> float:
        return samples(registry)[("kvrelay_connections", (("listener", "http"),))]

    assert count() == 0
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [listener.accept()[0] for _ in clients]
    assert count() == 3 and established_connections({port}) == {port: 3}
    for each in clients + accepted:
        each.close()
    wait_for(lambda: count() == 0, "closed connections still counted")
    listener.close()


def test_a_gpu_worker_reports_its_device_memory_by_kind() -> None:
    metrics = WorkerMetrics("decode", "decode-0")
    metrics.watch_device(StubGpu(free=3 << 30, allocated=70 << 30, reserved=72 << 30), lambda: 64 << 30)
    got = {
        dict(labels)["kind"]: value
        for (name, labels), value in samples(metrics.registry).items()
        if name == "kvrelay_gpu_memory_bytes"
    }
    assert got == {
        "allocated": 70 << 30, "reserved": 72 << 30, "free": 3 << 30, "total": 80 << 30, "kv_pool": 64 << 30,
    }  # fmt: skip
