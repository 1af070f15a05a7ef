"""The tiers below one worker's pool, fastest first, each behind its own breaker: the longest run of a
request's segments found in any of them (`fetch`), and writes on a thread of their own (`SegmentWriter`).

Reading: segment by segment in prefix order, each tier in turn, stopping at the first segment no tier
has. A tier the cost model (costs.py) expects to be slower than recomputing the segment is not asked. A
value that fails its checks (`check` raises SegmentMiss: corrupted, truncated, another namespace or tenant)
is deleted from that tier and counted; the next tier may still have it. A tier that does not answer counts
a failure on its breaker and is skipped; an open breaker skips it without asking. Past `deadline` the run
ends where it is: what was fetched is used, the rest recomputed.

Writing is an optimisation, never a requirement: `SegmentWriter.submit` queues a segment for every tier
and returns at once; the queue is bounded (a full queue drops the write), a key written recently is not
written again, and a byte budget per second drops what would exceed it. Every drop is counted.
"""

from __future__ import annotations

import bisect
import copy
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from services.kvcache.costs import FetchCosts
from services.kvcache.segment import SegmentMiss, tenant_of
from services.kvcache.tier import Breaker, Tier, TierUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TierStats:
    """Counts per tier name (`Counter`s keyed by the tier's `name`)."""

    hits: Counter[str] = field(default_factory=Counter)
    misses: Counter[str] = field(default_factory=Counter)
    corrupt: Counter[str] = field(default_factory=Counter)  # values that failed their checks (deleted)
    unavailable: Counter[str] = field(default_factory=Counter)  # calls that failed, or skipped while open
    bytes_read: Counter[str] = field(default_factory=Counter)
    bytes_written: Counter[str] = field(default_factory=Counter)
    writes_dropped: Counter[str] = field(default_factory=Counter)  # by reason: queue, budget
    fetch_seconds: dict[str, list[int]] = field(default_factory=dict)  # hits per FETCH_BUCKETS bucket
    fetch_seconds_sum: dict[str, float] = field(default_factory=dict)
    # By tenant tag (the key's third field: a hash of the salt, `-` for none): segments found in any tier,
    # and bytes written to the tiers.
    tenant_hits: Counter[str] = field(default_factory=Counter)
    tenant_bytes_written: Counter[str] = field(default_factory=Counter)
    fetched_tokens: int = 0  # prompt tokens placed from the tiers instead of computed
    late_lookups: int = 0  # lookups still running at their deadline (the request recomputed)

    def observe_fetch(self, tier: str, seconds: float) -> None:
        counts = self.fetch_seconds.setdefault(tier, [0] * (len(FETCH_BUCKETS) + 1))
        counts[bisect.bisect_left(FETCH_BUCKETS, seconds)] += 1
        self.fetch_seconds_sum[tier] = self.fetch_seconds_sum.get(tier, 0.0) + seconds

    def copy(self) -> TierStats:
        return copy.deepcopy(self)


FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # the last one is +Inf


@dataclass(frozen=True)
class Hold:
    """How a segment is written: `through` to the tiers that outlive the worker (disk, shared) or not,
    and kept `ttl_s` at least where values have lifetimes (None: the tier's own)."""

    through: bool = True
    ttl_s: int | None = None

    def covers(self, other: Hold) -> bool:
        """Whether a write held this way leaves nothing for a write held `other`'s way to add."""
        return self.through >= other.through and (self.ttl_s or 0) >= (other.ttl_s or 0)

    def join(self, other: Hold) -> Hold:
        """Held both ways: through if either is, as long as the longer."""
        ttls = [ttl for ttl in (self.ttl_s, other.ttl_s) if ttl is not None]
        return Hold(self.through or other.through, max(ttls) if ttls else None)


@dataclass(frozen=True)
class SegmentSize:
    """What one segment weighs: its value's bytes (about), and the tokens recomputing it costs."""

    num_bytes: int
    num_tokens: int


@dataclass(frozen=True)
class TierState:
    """One tier as `kvrelay status` and the metrics show it."""

    name: str
    up: bool  # its breaker lets calls through
    used_bytes: int | None
    evictions: int
    latency_s: float | None  # measured (costs.py); None until measured
    bytes_per_s: float | None


@dataclass(frozen=True)
class TierReport:
    tiers: list[TierState]
    stats: TierStats
    recompute_instead: dict[str, int]  # segments not asked of a tier the cost model judged slower


class TierSet:
    def __init__(
        self,
        tiers: Sequence[Tier],
        make_breaker: Callable[[], Breaker] = Breaker,
        costs: FetchCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = list(tiers)
        self.clock = clock
        self.breakers = {tier.name: make_breaker() for tier in self.tiers}
        self.costs = costs or FetchCosts()
        self.stats = TierStats()
        self._lock = threading.Lock()  # the writer thread and the readers share the breakers and counts

    def fetch(
        self,
        keys: Sequence[str],
        check: Callable[[int, bytes], bytes],
        deadline: float,
        size: SegmentSize,
    ) -> list[bytes]:
        """The checked payloads of keys[0], keys[1], ... up to the first one no tier holds (or `deadline`,
        on `clock`). `check(i, value)` returns segment i's payload or raises SegmentMiss."""
        payloads: list[bytes] = []
        for index, key in enumerate(keys):
            if self.clock() >= deadline:
                break
            payload = self._fetch_one(index, key, check, size)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def count_lookup(self, num_fetched_tokens: int, late: bool) -> None:
        with self._lock:
            self.stats.fetched_tokens += num_fetched_tokens
            self.stats.late_lookups += late

    def report(self) -> TierReport:
        costs, recompute_instead = self.costs.snapshot()
        with self._lock:
            states = [
                TierState(
                    tier.name,
                    self.breakers[tier.name].allow(),
                    tier.used_bytes(),
                    tier.evictions,
                    costs[tier.name].latency_s if tier.name in costs else None,
                    costs[tier.name].bytes_per_s if tier.name in costs else None,
                )
                for tier in self.tiers
            ]
            return TierReport(states, self.stats.copy(), recompute_instead)

    def _fetch_one(
        self, index: int, key: str, check: Callable[[int, bytes], bytes], size: SegmentSize
    ) -> bytes | None:
        for tier in self.tiers:
            if not self.costs.should_ask(tier.name, size.num_bytes, size.num_tokens):
                continue
            started = self.clock()
            answered, value = self._call(tier, partial(tier.get, key))
            seconds = self.clock() - started
            if answered:
                self.costs.observe_call(tier.name, seconds, len(value) if value is not None else 0)
            if value is None:
                if answered:  # a failed or skipped call counts as unavailable, not as a miss
                    with self._lock:
                        self.stats.misses[tier.name] += 1
                continue
            try:
                payload = check(index, value)
            except SegmentMiss as miss:
                log.warning("kv tier value refused", extra={"tier": tier.name, "reason": str(miss)})
                with self._lock:
                    self.stats.corrupt[tier.name] += 1
                self._call(tier, partial(tier.delete, key))
                continue
            with self._lock:
                self.stats.hits[tier.name] += 1
                self.stats.tenant_hits[tenant_of(key)] += 1
                self.stats.bytes_read[tier.name] += len(value)
                self.stats.observe_fetch(tier.name, seconds)
            return payload
        return None

    def count_dropped_write(self, reason: str) -> None:
        with self._lock:
            self.stats.writes_dropped[reason] += 1

    def put(self, key: str, value: bytes, hold: Hold = Hold()) -> None:
        """Store `value` in every tier that lacks it (on the caller's thread: the writer's); only in those
        that die with the worker unless `hold.through`."""
        for tier in self.tiers:
            if tier.outlives_worker and not hold.through:
                continue
            _, stored = self._call(tier, partial(tier.put, key, value, hold.ttl_s))
            if stored:
                with self._lock:
                    self.stats.bytes_written[tier.name] += len(value)
                    self.stats.tenant_bytes_written[tenant_of(key)] += len(value)

    def _call(self, tier: Tier, call: Callable[[], T]) -> tuple[bool, T | None]:
        """`call()` on `tier` behind its breaker: (True, its result), or (False, None) when the breaker is
        open or the tier fails."""
        breaker = self.breakers[tier.name]
        with self._lock:
            allowed = breaker.allow()
            if not allowed:
                self.stats.unavailable[tier.name] += 1
        if not allowed:
            return False, None
        try:
            result = call()
        except TierUnavailable as exc:
            with self._lock:
                breaker.record_failure()
                self.stats.unavailable[tier.name] += 1
            log.warning("kv tier unavailable", extra={"tier": tier.name, "error": str(exc)})
            return False, None
        with self._lock:
            breaker.record_success()
        return True, result


class SegmentWriter:
    """Writes queued segments to a TierSet on a daemon thread; see the module docstring for what drops."""

    def __init__(
        self,
        tiers: TierSet,
        *,
        max_queued: int = 64,
        bytes_per_s: float = 256e6,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = tiers
        self.bytes_per_s = bytes_per_s
        self.clock = clock
        self._queue: queue.Queue[tuple[str, Callable[[], bytes], Hold] | None] = queue.Queue(max_queued)
        self._written: OrderedDict[str, Hold] = OrderedDict()  # keys written lately, oldest first
        self._remember = remember
        self._budget = bytes_per_s  # a token bucket of bytes, one second deep
        self._refilled_at = clock()
        self._idle = threading.Condition()
        self._num_pending = 0
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def knows(self, key: str, hold: Hold = Hold()) -> bool:
        """Whether `key` was queued lately, held at least as `hold` asks (its segment need not be copied
        out again)."""
        known = self._written.get(key)
        return known is not None and known.covers(hold)

    def submit(self, key: str, num_bytes: int, make_value: Callable[[], bytes], hold: Hold = Hold()) -> bool:
        """Queue the value `make_value()` will build (on the writer's thread; about `num_bytes` long) under
        `key` for the tiers `hold` names; False when it is dropped (known, budget, queue)."""
        if self.knows(key, hold):
            return False
        if not self._take_budget(num_bytes):
            self._drop("budget")
            return False
        with self._idle:
            self._num_pending += 1
        try:
            self._queue.put_nowait((key, make_value, hold))
        except queue.Full:
            with self._idle:
                self._num_pending -= 1
            self._drop("queue")
            return False
        self._remember_key(key, hold)
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Block until every queued write is done (tests, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_pending == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.wait_idle(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return  # the daemon thread ends with the process
        self._thread.join(timeout)

    def _take_budget(self, num_bytes: int) -> bool:
        now = self.clock()
        self._budget = min(self.bytes_per_s, self._budget + (now - self._refilled_at) * self.bytes_per_s)
        self._refilled_at = now
        if num_bytes > self._budget:
            return False
        self._budget -= num_bytes
        return True

    def _remember_key(self, key: str, hold: Hold) -> None:
        known = self._written.pop(key, None)
        self._written[key] = hold if known is None else known.join(hold)
        while len(self._written) > self._remember:
            self._written.popitem(last=False)

    def _drop(self, reason: str) -> None:
        self.tiers.count_dropped_write(reason)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, make_value, hold = item
            try:
                self.tiers.put(key, make_value(), hold)
            except Exception:  # a write must never take the worker down
                log.exception("kv tier write failed")
            finally:
                with self._idle:
                    self._num_pending -= 1
                    self._idle.notify_all()
