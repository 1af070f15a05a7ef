"""What a quota store keeps and the arithmetic every store shares (quotas.py says how quotas work).

The window is a sliding minute, approximated from two fixed one-minute buckets (the standard
"sliding window counter"): with `f` the elapsed fraction of the current bucket,

    in use = previous bucket × (1 − f) + current bucket

so a burst at a bucket boundary cannot get twice the limit, and no per-request log is kept (each
counter is three numbers). Retry-After is computed from the same formula: the time until the previous
bucket has decayed enough, or, when the current bucket alone is too full, until it becomes the
previous one and decays enough. A settlement corrects the bucket its reservation was charged to (if
that bucket is still one of the two; an older one no longer counts anyway).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.codec.admission.errors import QuotaMetric

WINDOW_S = 60.0


@dataclass(frozen=True)
class Charge:
    """One counter a request is charged to: `cost` against `limit` per window."""

    counter: str  # the store's name for it, e.g. "tenant:alice:tokens"
    reason: str  # the metrics label and the name in messages, e.g. "tenant_tokens_per_minute"
    metric: QuotaMetric
    limit: int
    cost: int


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds. `charges` is empty when nothing was checked (no limits, or the
    store was down and quotas fail open): settling it does nothing."""

    tenant: str
    charges: tuple[Charge, ...]
    bucket: int  # the window bucket the charges went to
    num_tokens: int  # tokens reserved: prompt + n × max_tokens
    local: bool = False  # charged to this process's fallback store while the shared one was down


@dataclass(frozen=True)
class Denial:
    """No room in `charge`'s window. `retry_after_s` None: the request alone is over the limit."""

    charge: Charge
    in_use: int
    retry_after_s: float | None


class QuotaStoreUnavailableError(Exception):
    """The store could not be reached (or is cooling down after failing)."""


class QuotaStore(Protocol):
    async def reserve(self, tenant: str, charges: Sequence[Charge], num_tokens: int) -> Reservation | Denial:
        """Charges every counter if each has room, else charges none and says which needs the longest wait."""
        ...

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Corrects the tokens counters from the reserved count to `actual_tokens`."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Gives the whole reservation back (request and tokens): the request was never served."""
        ...

    async def usage(self, counter: str) -> tuple[int, int]:
        """(current bucket, previous bucket) of `counter` now; for inspection and tests."""
        ...

    async def aclose(self) -> None: ...


def counter_name(scope: str, metric: QuotaMetric, tenant: str | None = None) -> str:
    """ "global:requests", or "tenant:<quoted id>:tokens" (quoted, so no tenant ID can spell another key)."""
    if tenant is None:
        return f"{scope}:{metric}"
    return f"{scope}:{urllib.parse.quote(tenant, safe='')}:{metric}"


def settle_deltas(reservation: Reservation, actual_tokens: int) -> list[tuple[str, int]]:
    delta = actual_tokens - reservation.num_tokens
    return [(c.counter, delta) for c in reservation.charges if c.metric == "tokens" and delta]


def release_deltas(reservation: Reservation) -> list[tuple[str, int]]:
    return [(c.counter, -c.cost) for c in reservation.charges if c.cost]


def wait_s(
    limit: int, cost: int, current: int, previous: int, elapsed: float, window_s: float
) -> float | None:
    """Seconds until `cost` fits under `limit` if nothing else changes; None when it never can.
    `elapsed` is the fraction of the current bucket gone (the Lua script repeats this formula)."""
    if cost > limit:
        return None
    if current + cost <= limit:  # the previous bucket must decay: previous × (1 − f) ≤ room
        needed = 1.0 - (limit - current - cost) / previous if previous else elapsed
        return max(0.0, needed - elapsed) * window_s
    # the current bucket must first become the previous one, then decay
    needed_next = max(0.0, 1.0 - (limit - cost) / current) if current else 0.0
    return (1.0 - elapsed + needed_next) * window_s
