"""The quota store of one codec process: counters in memory (quota_store.py's window arithmetic)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.codec.admission.quota_store import (
    WINDOW_S,
    Charge,
    Denial,
    Reservation,
    release_deltas,
    settle_deltas,
    wait_s,
)


@dataclass
class _Counter:
    bucket: int
    current: int = 0
    previous: int = 0

    def rolled(self, bucket: int) -> tuple[int, int]:
        if self.bucket >= bucket:
            return self.current, self.previous
        if self.bucket == bucket - 1:
            return 0, self.current
        return 0, 0


@dataclass
class MemoryQuotaStore:
    """Counters in this process (one codec). `clock` is monotonic seconds (injectable for tests)."""

    window_s: float = WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _counters: dict[str, _Counter] = field(default_factory=dict)
    _pruned_bucket: int = -1

    def _now(self) -> tuple[int, float]:
        position = self.clock() / self.window_s
        bucket = math.floor(position)
        return bucket, position - bucket

    async def reserve(self, tenant: str, charges: Sequence[Charge], num_tokens: int) -> Reservation | Denial:
        bucket, elapsed = self._now()
        self._prune(bucket)
        worst: Denial | None = None
        for charge in charges:
            counter = self._counters.get(charge.counter)
            current, previous = counter.rolled(bucket) if counter else (0, 0)
            in_use = previous * (1.0 - elapsed) + current
            if in_use + charge.cost <= charge.limit:
                continue
            wait = wait_s(charge.limit, charge.cost, current, previous, elapsed, self.window_s)
            denial = Denial(charge, math.ceil(in_use), wait)
            if wait is None:
                return denial
            if worst is None or (worst.retry_after_s is not None and wait > worst.retry_after_s):
                worst = denial
        if worst is not None:
            return worst
        for charge in charges:
            counter = self._counters.get(charge.counter)
            current, previous = counter.rolled(bucket) if counter else (0, 0)
            self._counters[charge.counter] = _Counter(bucket, current + charge.cost, previous)
        return Reservation(tenant, tuple(charges), bucket, num_tokens)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        self._adjust(reservation.bucket, settle_deltas(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        self._adjust(reservation.bucket, release_deltas(reservation))

    def _adjust(self, bucket: int, deltas: Sequence[tuple[str, int]]) -> None:
        for name, delta in deltas:
            counter = self._counters.get(name)
            if counter is None:
                continue
            if counter.bucket == bucket:
                counter.current = max(0, counter.current + delta)
            elif counter.bucket == bucket + 1:
                counter.previous = max(0, counter.previous + delta)

    async def usage(self, counter: str) -> tuple[int, int]:
        found = self._counters.get(counter)
        return found.rolled(self._now()[0]) if found else (0, 0)

    def _prune(self, bucket: int) -> None:
        """Drops counters that no longer count (once per bucket), so memory follows active tenants."""
        if bucket == self._pruned_bucket:
            return
        self._pruned_bucket = bucket
        for name in [n for n, c in self._counters.items() if c.bucket < bucket - 1]:
            del self._counters[name]

    async def aclose(self) -> None:
        self._counters.clear()
