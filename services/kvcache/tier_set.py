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
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from services.kvcache.costs import FetchCosts
from services.kvcache.segment import SegmentMiss, last_block_of, tenant_of
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
class SegmentRef:
    """Where a segment sits in its prompt, for the KV events: its last block's hash (its key's last field),
    the block it starts at, and its length in blocks."""

    last_block: bytes
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class TierEvent:
    """A segment written to a tier (`stored`: there now, kept `ttl_s` at least where values have
    lifetimes, else 0), or removed from it (evicted for room, refused as corrupt)."""

    tier: str
    stored: bool
    last_block: bytes
    first_block: int = 0
    num_blocks: int = 0
    ttl_s: int = 0


EVENTS_KEPT = 8192  # tier events kept until taken; a router this far behind misses the oldest


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
        self._events: deque[TierEvent] = deque(maxlen=EVENTS_KEPT)
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
                    self._events.append(TierEvent(tier.name, False, last_block_of(key)))
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

    def put(self, key: str, value: bytes, hold: Hold = Hold(), ref: SegmentRef | None = None) -> None:
        """Store `value` in every tier that lacks it (on the caller's thread: the writer's); only in those
        that die with the worker unless `hold.through`. With `ref`, each tier that answered, and what it
        evicted for room, becomes a TierEvent (`take_events`)."""
        for tier in self.tiers:
            if tier.outlives_worker and not hold.through:
                continue
            answered, stored = self._call(tier, partial(tier.put, key, value, hold.ttl_s))
            evicted = tier.take_evicted()
            with self._lock:
                if stored:
                    self.stats.bytes_written[tier.name] += len(value)
                    self.stats.tenant_bytes_written[tenant_of(key)] += len(value)
                if answered and ref is not None:  # there now, stored by this call or an earlier one
                    ttl_s = max(hold.ttl_s or 0, tier.ttl_s) if tier.ttl_s is not None else 0
                    self._events.append(
                        TierEvent(tier.name, True, ref.last_block, ref.first_block, ref.num_blocks, ttl_s)
                    )
                # After: a put that evicts for room may evict what it just stored (a tenant's cap).
                self._events.extend(TierEvent(tier.name, False, last_block_of(gone)) for gone in evicted)

    def take_events(self) -> list[TierEvent]:
        """What the tiers gained and lost since the last call: one event per tier and segment, the last
        (two writes in a row: the longer lifetime, which is what the tier keeps)."""
        latest: dict[tuple[str, bytes], TierEvent] = {}
        with self._lock:
            for event in self._events:
                known = latest.get((event.tier, event.last_block))
                if known is not None and known.stored and event.stored and known.ttl_s > event.ttl_s:
                    event = known
                latest[event.tier, event.last_block] = event
            self._events.clear()
        return list(latest.values())

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


@dataclass(frozen=True)
class _Write:
    key: str
    make_value: Callable[[], bytes]
    hold: Hold
    ref: SegmentRef | None


class SegmentWriter:
    """Writes queued segments to a TierSet on a daemon thread; see the module docstring for what drops."""

    def __init__(
        self,
        tiers: TierSet,
        *,
        max_queued: int = 64,
        bytes_per_s: float = 256e6,
        remember: int = 4096,
        refresh_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`refresh_s`: a key written this long ago is written again when asked (a prefix the pool keeps
        serving would otherwise outlive its lifetime in the tiers); None: never."""
        self.tiers = tiers
        self.bytes_per_s = bytes_per_s
        self.refresh_s = refresh_s
        self.clock = clock
        self._queue: queue.Queue[_Write | None] = queue.Queue(max_queued)
        self._written: OrderedDict[str, tuple[Hold, float]] = OrderedDict()  # lately, oldest first: how, when
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
        if known is None or not known[0].covers(hold):
            return False
        return self.refresh_s is None or self.clock() - known[1] < self.refresh_s

    def submit(
        self,
        key: str,
        num_bytes: int,
        make_value: Callable[[], bytes],
        hold: Hold = Hold(),
        ref: SegmentRef | None = None,
    ) -> bool:
        """Queue the value `make_value()` will build (on the writer's thread; about `num_bytes` long) under
        `key` for the tiers `hold` names (`ref`: for the tier events); False when it is dropped (known,
        budget, queue)."""
        if self.knows(key, hold):
            return False
        if not self._take_budget(num_bytes):
            self._drop("budget")
            return False
        with self._idle:
            self._num_pending += 1
        try:
            self._queue.put_nowait(_Write(key, make_value, hold, ref))
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
        if known is not None:
            hold = known[0].join(hold)
        self._written[key] = (hold, self.clock())
        while len(self._written) > self._remember:
            self._written.popitem(last=False)

    def _drop(self, reason: str) -> None:
        self.tiers.count_dropped_write(reason)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.tiers.put(item.key, item.make_value(), item.hold, item.ref)
            except Exception:  # a write must never take the worker down
                log.exception("kv tier write failed")
            finally:
                with self._idle:
                    self._num_pending -= 1
                    self._idle.notify_all()
