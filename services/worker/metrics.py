"""A worker's Prometheus metrics, served over HTTP on `--metrics-port` (off when not given).

Gauges and totals are read from the engine's last stats snapshot and the transfer counters at scrape
time (a custom collector: nothing to keep in sync). Histograms are observed on the engine thread after
every step: step time, and each newly admitted request's queue time (arrival to first schedule).
Every series carries the worker's `role` and `worker` name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.process_metrics import register_process_metrics
from services.engine.async_engine import AsyncEngine
from services.engine.loading.device import MemoryProbe
from services.kvcache.tier_set import FETCH_BUCKETS, TierReport
from services.worker.counters import TransferCounters

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, role: str, name: str) -> None:
        self.registry = CollectorRegistry()
        register_process_metrics(self.registry)
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
        self.encoder_seconds = Histogram(
            "kvrelay_engine_encoder_seconds",
            "Encoder-decoder models: host time of one batched encoder pass with its cross KV writes "
            "(on a GPU, the time to queue them).",
            list(self.labels),
            buckets=STEP_BUCKETS,
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

    def observe_step(
        self, seconds: float, num_tokens: int, queue_times: list[float], encoder_times: Sequence[float] = ()
    ) -> None:
        self.step_seconds.observe(seconds)
        for queued in queue_times:
            self.queue_seconds.observe(queued)
        for encoded in encoder_times:
            self.encoder_seconds.observe(encoded)

    def watch(
        self, engine: AsyncEngine, counters: TransferCounters, *, weight_bytes: int | None = None
    ) -> None:
        """Export the engine's stats and the transfer counters; `weight_bytes` (the resident bytes of the
        model's weights, every copy) as a gauge when given."""
        counters.on_transfer = self.observe_transfer
        self.registry.register(_EngineCollector(engine, counters, self.labels, weight_bytes))

    def watch_device(self, probe: MemoryProbe, kv_pool_bytes: Callable[[], int]) -> None:
        """Export a GPU's memory as this process sees it (`probe`), with the KV pool's share."""
        self.registry.register(_DeviceMemoryCollector(probe, kv_pool_bytes, self.labels))

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _DeviceMemoryCollector(Collector):
    """`kvrelay_gpu_memory_bytes{kind}`: allocated (live tensors), reserved (the caching allocator's hold),
    free and total (the device's, every process's use counted), kv_pool (the KV cache's blocks)."""

    def __init__(self, probe: MemoryProbe, kv_pool_bytes: Callable[[], int], labels: dict[str, str]) -> None:
        self.probe = probe
        self.kv_pool_bytes = kv_pool_bytes
        self.names = list(labels)
        self.values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        free, total = self.probe.mem_get_info()
        family = GaugeMetricFamily(
            "kvrelay_gpu_memory_bytes",
            "GPU memory by kind: allocated, reserved (this process's allocator), free and total (the "
            "device's), kv_pool (the KV cache's blocks).",
            labels=[*self.names, "kind"],
        )
        for kind, value in (
            ("allocated", self.probe.memory_allocated()), ("reserved", self.probe.memory_reserved()),
            ("free", free), ("total", total), ("kv_pool", self.kv_pool_bytes()),
        ):  # fmt: skip
            family.add_metric([*self.values, kind], value)
        yield family


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
        tiers = self.engine.tier_report()
        if tiers is not None:
            yield from self._tier_metrics(tiers)
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

    def _tier_metrics(self, report: TierReport) -> Iterator[Metric]:
        """The KV tiers below the pool (docs/kv-tiers.md): one series per tier (or drop reason)."""
        stats = report.stats
        by_tier = [
            ("hits", "Segments found in the tier.", stats.hits),
            ("misses", "Segments asked of the tier and not found.", stats.misses),
            ("refused", "Values that failed their checks (corrupted, foreign): deleted.", stats.corrupt),
            ("unavailable", "Calls failed, or skipped while the breaker was open.", stats.unavailable),
            ("read_bytes", "Bytes read from the tier.", stats.bytes_read),
            ("written_bytes", "Bytes written to the tier.", stats.bytes_written),
            ("recompute_instead", "Segments not asked of a tier the cost model found slower than recompute.",
             report.recompute_instead),
            ("evictions", "Values this worker removed from the tier for room.",
             {tier.name: tier.evictions for tier in report.tiers}),
        ]  # fmt: skip
        names = [tier.name for tier in report.tiers]
        for suffix, doc, values in by_tier:
            family = CounterMetricFamily(f"kvrelay_kv_tier_{suffix}", doc, labels=[*self.names, "tier"])
            for name in names:
                family.add_metric([*self.values, name], values.get(name, 0))
            yield family
        dropped = CounterMetricFamily(
            "kvrelay_kv_tier_writes_dropped",
            "Segment writes dropped, by reason (queue full, byte budget).",
            labels=[*self.names, "reason"],
        )
        for reason in ("queue", "budget"):
            dropped.add_metric([*self.values, reason], stats.writes_dropped.get(reason, 0))
        yield dropped
        up = GaugeMetricFamily(
            "kvrelay_kv_tier_up", "1 while the tier's breaker lets calls through, 0 while open.",
            labels=[*self.names, "tier"],
        )  # fmt: skip
        used = GaugeMetricFamily(
            "kvrelay_kv_tier_used_bytes", "Bytes the tier holds, where this worker can tell cheaply.",
            labels=[*self.names, "tier"],
        )  # fmt: skip
        for tier in report.tiers:
            up.add_metric([*self.values, tier.name], 1.0 if tier.up else 0.0)
            if tier.used_bytes is not None:
                used.add_metric([*self.values, tier.name], tier.used_bytes)
        yield up
        yield used
        fetch = HistogramMetricFamily(
            "kvrelay_kv_tier_fetch_seconds", "Time to fetch one segment that was found.",
            labels=[*self.names, "tier"],
        )  # fmt: skip
        for name in names:
            counts = stats.fetch_seconds.get(name, [0] * (len(FETCH_BUCKETS) + 1))
            bounds = [*(str(b) for b in FETCH_BUCKETS), "+Inf"]
            cumulative = list(zip(bounds, itertools.accumulate(counts), strict=True))
            fetch.add_metric([*self.values, name], cumulative, stats.fetch_seconds_sum.get(name, 0.0))
        yield fetch
        for suffix, doc, values in (
            ("hits", "Segments found in any tier, by tenant tag (a hash of its salt).", stats.tenant_hits),
            ("written_bytes", "Bytes written to the tiers, by tenant tag.", stats.tenant_bytes_written),
        ):
            family = CounterMetricFamily(
                f"kvrelay_kv_tier_tenant_{suffix}", doc, labels=[*self.names, "tenant"]
            )
            for tenant, value in sorted(values.items()):
                family.add_metric([*self.values, tenant], value)
            yield family
        yield self._counter(
            "kvrelay_kv_tier_fetched_tokens",
            "Prompt tokens loaded from the tiers below the pool instead of computed.",
            stats.fetched_tokens,
        )
        yield self._counter(
            "kvrelay_kv_tier_late_lookups",
            "Lookups still running at their deadline (their requests recomputed).",
            stats.late_lookups,
        )

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        return family
