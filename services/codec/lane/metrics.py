"""The async lane's instruments (docs/observability.md), on the codec's registry.

The queue's own state lives in Redis, so every codec with `queue.url` reports the same numbers: it reads
them every `queue.metrics_refresh_ms` (aggregate across replicas with max). What a codec did itself
(jobs it queued, jobs its drainer finished) is counted per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.codec.lane.queue import ClassStats, JobQueue, QueueUnavailableError
from services.common import priority

logger = logging.getLogger("kvrelay.queue")
REFRESH_S = 5.0  # queue.metrics_refresh_ms's default


class LaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Gauge(
            "kvrelay_queue_jobs",
            "Jobs on the durable queue by priority class and state: queued (not yet taken) or running "
            "(taken by a drainer, not finished). Read from the queue's Redis: every codec reports the same.",
            ["class", "state"],
            registry=registry,
        )
        self.oldest_age = Gauge(
            "kvrelay_queue_oldest_job_age_seconds",
            "Age of the oldest unfinished job on the durable queue, by priority class (0 when none).",
            ["class"],
            registry=registry,
        )
        self.up = Gauge(
            "kvrelay_queue_up", "1 when the queue's Redis answered the last read, else 0.", registry=registry
        )
        self.created = Counter(
            "kvrelay_queue_jobs_created_total",
            "Background jobs this codec queued, by priority class.",
            ["class"],
            registry=registry,
        )
        self.drained = Counter(
            "kvrelay_queue_jobs_drained_total",
            "Jobs this codec's drainer ended, by outcome: completed, incomplete, failed, cancelled; "
            "released (given back at shutdown) and retried (refused for a quota or overload, tried again).",
            ["outcome"],
            registry=registry,
        )
        self.latest: list[ClassStats] = []  # the last read, for /status

    def show(self, stats: list[ClassStats]) -> None:
        self.latest = stats
        for s in stats:
            name = priority.name_of(s.priority)
            self.jobs.labels(name, "queued").set(s.queued)
            self.jobs.labels(name, "running").set(s.running)
            self.oldest_age.labels(name).set(s.oldest_age_s)

    async def refresh_forever(self, queue: JobQueue, every_s: float = REFRESH_S) -> None:
        """Read the queue's state every `every_s` until cancelled; first, warn once about what makes its
        Redis unfit for the queue role (eviction on, no append-only file)."""
        with contextlib.suppress(QueueUnavailableError):
            for problem in await queue.check_server():
                logger.warning("the queue's Redis is not configured for the queue role: %s", problem)
        while True:
            try:
                self.show(await queue.stats())
                self.up.set(1)
            except QueueUnavailableError:
                self.up.set(0)
            await asyncio.sleep(every_s)


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Gauge(
            "kvrelay_batches",
            "Batches in the batch store by status (in_progress, cancelling, expiring, completed, cancelled, "
            "expired). Read from the store: every codec reports the same.",
            ["status"],
            registry=registry,
        )
        self.oldest_age = Gauge(
            "kvrelay_batch_oldest_unfinished_age_seconds",
            "Age of the oldest batch not yet ended (0 when none).",
            registry=registry,
        )
        self.up = Gauge(
            "kvrelay_batch_store_up",
            "1 when the batch store answered the last read, else 0.",
            registry=registry,
        )
        self.created = Counter(
            "kvrelay_batches_created_total", "Batches this codec created, by API.", ["api"], registry=registry
        )
        self.ended = Counter(
            "kvrelay_batches_ended_total",
            "Batches this codec ended, by API and final status.",
            ["api", "status"],
            registry=registry,
        )
        self.lines = Counter(
            "kvrelay_batch_lines_total",
            "Batch lines this codec's drainer ended, by outcome: succeeded, errored, cancelled, expired, "
            "skipped (done already); retried counts refusals for a quota or overload. Lines per second: "
            "rate().",
            ["outcome"],
            registry=registry,
        )
        self.seen: set[str] = set()

    def show(self, by_status: dict[str, int], oldest_age_s: float) -> None:
        for status in self.seen | set(by_status):
            self.batches.labels(status).set(by_status.get(status, 0))
        self.seen |= set(by_status)
        self.oldest_age.set(oldest_age_s)


@contextlib.asynccontextmanager
async def refreshing(
    metrics: LaneMetrics, queue: JobQueue, every_s: float = REFRESH_S
) -> AsyncIterator[None]:
    """Around an app's life: the queue's gauges read every `every_s`."""
    task = asyncio.create_task(metrics.refresh_forever(queue, every_s))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
