"""A worker's Prometheus metrics, served over HTTP on `--metrics-port` (off when not given).

Gauges and totals are read from the engine's last stats snapshot and the transfer counters at scrape
time (a custom collector: nothing to keep in sync). Histograms are observed on the engine thread after
every step: step time, and each newly admitted request's queue time (arrival to first schedule).
Every series carries the worker's `role` and `worker` name.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.engine.async_engine import AsyncEngine
from services.worker.counters import TransferCounters

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, role: str, name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"role": role, "worker": name}
        self.step_seconds = Histogram(
            "kvrelay_engine_step_seconds",
            "Time of one engine step.",
            list(self.labels),
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(**self.labels)
        self.queue_seconds = Histogram(
            "kvrelay_queue_time_seconds",
            "Time from arrival to a request's first engine step.",
            list(self.labels),
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        ).labels(**self.labels)
        self.transfer_seconds = Histogram(
            "kvrelay_kv_transfer_seconds",
            "Decode side: from the Prefill call's start to the prompt's KV installed (successful transfers).",
            list(self.labels),
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        ).labels(**self.labels)

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_seconds.observe(seconds)

    def observe_step(self, seconds: float, num_tokens: int, queue_times: list[float]) -> None:
        self.step_seconds.observe(seconds)
        for queued in queue_times:
            self.queue_seconds.observe(queued)

    def watch(
        self, engine: AsyncEngine, counters: TransferCounters, *, weight_bytes: int | None = None
    ) -> None:
        """Export the engine's stats and the transfer counters; `weight_bytes` (the resident bytes of the
        model's weights, every copy) as a gauge when given."""
        counters.on_transfer = self.observe_transfer
        self.registry.register(_EngineCollector(engine, counters, self.labels, weight_bytes))

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _EngineCollector(Collector):
    def __init__(
        self,
        engine: AsyncEngine,
        counters: TransferCounters,
        labels: dict[str, str],
        weight_bytes: int | None,
    ) -> None:
        self.engine = engine
        self.weight_bytes = weight_bytes
        self.counters = counters
        self.names = list(labels)
        self.values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield self._gauge(
            "kvrelay_worker_running_requests", "Requests running (or receiving KV).", stats.num_running
        )
        yield self._gauge(
            "kvrelay_worker_waiting_requests", "Requests waiting for a first step.", stats.num_waiting
        )
        blocks = GaugeMetricFamily(
            "kvrelay_kv_blocks", "KV cache blocks by state.", labels=[*self.names, "state"]
        )
        kv = stats.kv_blocks
        for state, value in (("active", kv.num_active), ("cached", kv.num_cached), ("free", kv.num_free)):
            blocks.add_metric([*self.values, state], value)
        yield blocks
        yield self._gauge("kvrelay_kv_blocks_total", "KV cache blocks in the pool.", kv.num_total)
        yield self._counter(
            "kvrelay_worker_prefix_cache_query_tokens", "Prompt tokens looked up.", stats.prefix_cache_queries
        )
        yield self._counter(
            "kvrelay_worker_prefix_cache_hit_tokens", "Prompt tokens found cached.", stats.prefix_cache_hits
        )
        yield self._counter(
            "kvrelay_engine_preemptions", "Requests preempted for KV room.", stats.num_preemptions
        )
        yield self._counter(
            "kvrelay_worker_aborted_requests",
            "Requests aborted while live (client gone, cancel, deadline, shutdown).",
            stats.num_aborted,
        )
        yield self._counter(
            "kvrelay_worker_generation_tokens",
            "Tokens sampled by this worker's engine (on a prefill worker: each first token).",
            stats.num_generated_tokens,
        )
        steps = CounterMetricFamily(
            "kvrelay_engine_steps",
            "Engine steps by the path the model's layers took: kernels (one C call over every layer, "
            "small steps) or gemm (torch's matmuls, large steps).",
            labels=[*self.names, "path"],
        )
        for path, value in sorted(stats.steps_by_path.items()):
            steps.add_metric([*self.values, path], value)
        yield steps
        if self.weight_bytes is not None:
            yield self._gauge(
                "kvrelay_model_weight_bytes",
                "Resident bytes of every copy of the model's weights the engine holds.",
                self.weight_bytes,
            )
        yield self._counter(
            "kvrelay_kv_transfer_bytes",
            "KV bytes sent (prefill) or received (decode).",
            self.counters.bytes_total,
        )
        yield self._counter(
            "kvrelay_remote_prefills",
            "Requests whose KV crossed to or from a peer.",
            self.counters.remote_prefills_total,
        )
        yield self._counter(
            "kvrelay_prefill_fallbacks", "Remote prefills recomputed locally.", self.counters.fallbacks_total
        )
        yield self._counter(
            "kvrelay_kv_ipc_refusals",
            "ipc handles this decode worker could not open (the KV then came over grpc).",
            self.counters.ipc_refusals_total,
        )

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        return family
