"""What a tier below a worker's pool offers (the backend interface), and the breaker in front of a remote one.

A tier stores immutable values under content-addressed keys (segment.py): `put` never overwrites (the same
key always holds the same bytes, so a second writer has nothing to add, but may lengthen its lifetime),
`get` refreshes a hit's lifetime.
The engine talks to this interface only, so another store (a cluster cache, an object store) is a new class
here and nothing else. A tier that cannot be reached raises `TierUnavailable`; the caller takes the no-cache
path (recompute), counts it and logs it, never fails the request.

`Breaker` stops asking a tier that keeps failing: after `failure_threshold` failures in a row it opens for
`cooldown_s` (every call is skipped as a miss), then lets one call through; a success closes it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

EVICTED_KEPT = 4096  # evicted keys a tier remembers until asked (`take_evicted`); older ones are forgotten


class TierUnavailable(Exception):
    """The tier did not answer (down, timed out, refused): take the no-cache path."""


class Tier(Protocol):
    name: str  # "host", "disk", "shared": the tier's label on metrics and logs
    evictions: int  # values this process removed for room (a Redis's own evictions are its to count)
    outlives_worker: bool  # disk and shared: a write here is a write-through (kv_tiers.write_through)

    @property
    def ttl_s(self) -> int | None:
        """A value's lifetime, renewed by hits; None: kept until pushed out for room."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value under `key` (its lifetime refreshed), or None."""
        ...

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        """Store `value` under `key` unless a value is there already; True if this call stored it. A tier
        with lifetimes keeps it `ttl_s` at least (None: its own), and lengthens, never shortens, the
        lifetime of a value already there; the others bound by room alone and ignore `ttl_s`."""
        ...

    def contains(self, keys: list[str]) -> list[bool]:
        """For each key, whether the tier holds it now (a hint: it may be gone by the `get`)."""
        ...

    def delete(self, key: str) -> None:
        """Drop `key` (a value that failed its checks)."""
        ...

    def used_bytes(self) -> int | None:
        """The bytes the tier holds, as far as this process knows cheaply; None when it cannot."""
        ...

    def take_evicted(self) -> list[str]:
        """The keys this process removed for room since the last call (at most EVICTED_KEPT, the latest)."""
        ...


class Breaker:
    """Closed, open for `cooldown_s` after `failure_threshold` failures in a row, then half-open."""

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.num_failures = 0
        self.opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None and self.clock() - self.opened_at < self.cooldown_s

    def allow(self) -> bool:
        """Whether to try the tier now: closed, or half-open once the cooldown has passed."""
        return not self.is_open

    def record_success(self) -> None:
        self.num_failures = 0
        self.opened_at = None

    def record_failure(self) -> None:
        self.num_failures += 1
        if self.num_failures >= self.failure_threshold:
            self.opened_at = self.clock()  # (re)open: a half-open probe that fails waits a full cooldown
