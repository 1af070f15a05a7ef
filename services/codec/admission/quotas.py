"""Requests and tokens per minute, per tenant and overall: reserve at admission, settle at the end.

Each request is charged to up to four counters, each with its own limit (unset limits are not kept):

    tenant requests/min   quotas.tenants[t].requests_per_minute, else quotas.default_requests_per_minute
    tenant tokens/min     quotas.tenants[t].tokens_per_minute,   else quotas.default_tokens_per_minute
    global requests/min   quotas.global_requests_per_minute
    global tokens/min     quotas.global_tokens_per_minute

A request costs 1 request and `prompt + n × max_tokens` tokens (max_tokens as admission resolved it:
`limits.default_max_output_tokens` when the request gave none). `reserve` checks every counter and
charges all of them, or none: the refusal names the counter that needs the longest wait, and that
wait is the Retry-After. At the end the reservation is settled: the tokens counters are corrected to
what the request really used (prompt + generated). A request that never reached the backend (refused
by the queue, cancelled while queued, backend down) is released: request and tokens both come back.

The window is a sliding minute (quota_store.py has the arithmetic). Two stores implement it:
`MemoryQuotaStore` (quota_memory.py, one codec process) and `RedisQuotaStore` (quota_redis.py, shared
by codec replicas, atomic in one Lua script).

`Quotas` applies the configuration on top of a store, counts refusals, and follows `quotas.fail_open`
when the store cannot be reached, both logged and counted:

- fail closed (`fail_open: false`): a 503 with Retry-After.
- fail open (the default, and the chart's): this process checks the request against its own memory store
  instead, each limit divided by the number of codec replicas. That number follows the autoscaler: while
  Redis is up, each replica beats into a sorted set in it (at most every HEARTBEAT_INTERVAL_S, on the
  request path), and the count of replicas that beat within REPLICA_ALIVE_S is kept. Never having seen
  Redis, a replica divides by `quotas.fallback_replicas` (the chart sets the autoscaler's maximum).
  Settling and releasing go to whichever store the reservation was charged to.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import anyio

from services.codec.admission.errors import QuotaMetric, QuotaUnavailableError, RateLimitedError
from services.codec.admission.metrics import LimitsMetrics
from services.codec.admission.quota_memory import MemoryQuotaStore
from services.codec.admission.quota_redis import RedisQuotaStore
from services.codec.admission.quota_store import (
    WINDOW_S,
    Charge,
    Denial,
    QuotaStore,
    QuotaStoreUnavailableError,
    Reservation,
    counter_name,
)
from services.common.config import QuotasConfig

logger = logging.getLogger(__name__)

DOWN_LOG_INTERVAL_S = 10.0
HEARTBEAT_INTERVAL_S = 10.0
REPLICA_ALIVE_S = 3 * HEARTBEAT_INTERVAL_S


_METRIC_WORDS = {"requests": "requests per minute", "tokens": "tokens per minute"}


class Quotas:
    """The configured limits over a store; refusals raise, and store failures follow `fail_open`."""

    def __init__(
        self,
        config: QuotasConfig,
        store: QuotaStore,
        metrics: LimitsMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self.store = store
        self._metrics = metrics
        self._clock = clock
        self._store_down_since: float | None = None
        self._last_down_log = -math.inf
        # fail open over a shared store: this process's share of each limit while that store is down
        self.fallback = MemoryQuotaStore(clock=clock) if isinstance(store, RedisQuotaStore) else None
        self.replica_id = secrets.token_hex(8)
        self.replicas_seen: int | None = None  # live codec replicas at the last heartbeat
        self._last_beat = -math.inf

    @classmethod
    def from_config(cls, config: QuotasConfig, metrics: LimitsMetrics, *, key_prefix: str) -> Quotas:
        store: QuotaStore
        if config.backend == "redis":
            store = RedisQuotaStore.from_url(config.redis_url, key_prefix=key_prefix)
        else:
            store = MemoryQuotaStore()
        return cls(config, store, metrics)

    def charges(self, tenant: str, num_tokens: int, only: QuotaMetric | None = None) -> tuple[Charge, ...]:
        """The counters a request of `tenant` costing `num_tokens` is charged to (set limits only; with
        `only`, those of that metric alone)."""
        cfg = self._config
        own = cfg.tenants.get(tenant)
        tenant_rpm = own.requests_per_minute if own and own.requests_per_minute else None
        tenant_tpm = own.tokens_per_minute if own and own.tokens_per_minute else None
        limits: list[tuple[str, QuotaMetric, str | None, int | None, int]] = [
            ("tenant", "requests", tenant, tenant_rpm or cfg.default_requests_per_minute, 1),
            ("tenant", "tokens", tenant, tenant_tpm or cfg.default_tokens_per_minute, num_tokens),
            ("global", "requests", None, cfg.global_requests_per_minute, 1),
            ("global", "tokens", None, cfg.global_tokens_per_minute, num_tokens),
        ]
        return tuple(
            Charge(counter_name(scope, metric, who), f"{scope}_{metric}_per_minute", metric, limit, cost)
            for scope, metric, who, limit, cost in limits
            if limit is not None and only in (None, metric)
        )

    async def reserve(self, tenant: str, num_tokens: int, only: QuotaMetric | None = None) -> Reservation:
        """The tenant's reservation, or RateLimitedError (429) / QuotaUnavailableError (503, fail closed).
        `only`: charge the counters of that metric alone (the request was charged the other already)."""
        charges = self.charges(tenant, num_tokens, only)
        if not charges:
            return self._opened(Reservation(tenant, (), 0, num_tokens))
        try:
            with anyio.CancelScope(shield=True):  # once sent, the answer must be known to be undone
                outcome = await self.store.reserve(tenant, charges, num_tokens)
        except QuotaStoreUnavailableError as exc:
            return self._opened(await self._store_down(tenant, charges, num_tokens, exc))
        self._store_up()
        await self._beat()
        if isinstance(outcome, Denial):
            self._metrics.reject(tenant, outcome.charge.reason)
            raise _rate_limited(tenant, outcome)
        return self._opened(outcome)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Corrects the tokens counters to what was used. Never raises (it runs in cleanup)."""
        self._closed(reservation)
        store = self._store_of(reservation)
        await self._adjust("settle", reservation, lambda: store.settle(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        """Gives the whole reservation back. Never raises (it runs in cleanup)."""
        self._closed(reservation)
        store = self._store_of(reservation)
        await self._adjust("release", reservation, lambda: store.release(reservation))

    async def refund(self, reservation: Reservation) -> None:
        """Gives back a reservation already settled (a request charged at entry that was never served).
        Never raises."""
        store = self._store_of(reservation)
        await self._adjust("release", reservation, lambda: store.release(reservation))

    async def aclose(self) -> None:
        await self.store.aclose()

    @property
    def fallback_replicas(self) -> int:
        """What each limit is divided by while the shared store is down."""
        return self.replicas_seen or self._config.fallback_replicas

    def _store_of(self, reservation: Reservation) -> QuotaStore:
        return self.fallback if reservation.local and self.fallback is not None else self.store

    async def _beat(self) -> None:
        """Counts the live codec replicas (at most every HEARTBEAT_INTERVAL_S), for the fail-open share."""
        now = self._clock()
        if self.fallback is None or now - self._last_beat < HEARTBEAT_INTERVAL_S:
            return
        self._last_beat = now
        assert isinstance(self.store, RedisQuotaStore)
        try:
            with anyio.CancelScope(shield=True):
                alive = await self.store.heartbeat(self.replica_id, REPLICA_ALIVE_S)
        except QuotaStoreUnavailableError:
            return
        if alive != self.replicas_seen:
            logger.info("codec replicas sharing the quotas", extra={"replicas": alive})
        self.replicas_seen = max(1, alive)

    async def _adjust(
        self, operation: str, reservation: Reservation, call: Callable[[], Awaitable[None]]
    ) -> None:
        if not reservation.charges:
            return
        try:
            with anyio.CancelScope(shield=True):
                await call()
        except QuotaStoreUnavailableError as exc:
            self._metrics.store_errors.labels(operation=operation, outcome="lost").inc()
            self._log_down(f"quota {operation} lost, the store is unreachable: {exc}")
        except Exception as exc:  # cleanup must not fail the response
            self._metrics.store_errors.labels(operation=operation, outcome="lost").inc()
            logger.error("quota %s failed: %s", operation, type(exc).__name__, exc_info=exc)

    def _opened(self, reservation: Reservation) -> Reservation:
        self._metrics.open_reservations.inc()
        self._metrics.reserved_tokens.inc(reservation.num_tokens)
        return reservation

    def _closed(self, reservation: Reservation) -> None:
        self._metrics.open_reservations.dec()
        self._metrics.reserved_tokens.dec(reservation.num_tokens)

    async def _store_down(
        self, tenant: str, charges: tuple[Charge, ...], num_tokens: int, exc: Exception
    ) -> Reservation:
        if self._store_down_since is None:
            self._store_down_since = self._clock()
        if not self._config.fail_open:
            self._metrics.store_errors.labels(operation="reserve", outcome="refused").inc()
            self._metrics.reject(tenant, "quota_store_down")
            self._log_down(f"quota store unreachable, refusing requests (fail closed): {exc}")
            raise QuotaUnavailableError(
                "quotas cannot be checked now (the quota store is unreachable); retry later"
            )
        if self.fallback is None:  # no shared store to fall back from: nothing else to check against
            self._metrics.store_errors.labels(operation="reserve", outcome="admitted").inc()
            return Reservation(tenant, (), 0, num_tokens)
        replicas = self.fallback_replicas
        self._metrics.store_errors.labels(operation="reserve", outcome="fallback").inc()
        self._log_down(
            f"quota store unreachable, checking each limit / {replicas} codec replicas in this process "
            f"(fail open): {exc}"
        )
        share = tuple(replace(c, limit=max(1, c.limit // replicas)) for c in charges)
        outcome = await self.fallback.reserve(tenant, share, num_tokens)
        if isinstance(outcome, Denial):
            self._metrics.reject(tenant, outcome.charge.reason)
            raise _rate_limited(tenant, outcome)
        return replace(outcome, local=True)

    def _store_up(self) -> None:
        if self._store_down_since is not None:
            logger.warning("quota store reachable again after %.1f s", self._clock() - self._store_down_since)
            self._store_down_since = None
            self._last_down_log = -math.inf

    def _log_down(self, message: str) -> None:
        now = self._clock()
        if now - self._last_down_log >= DOWN_LOG_INTERVAL_S:
            self._last_down_log = now
            logger.warning(message)


def _rate_limited(tenant: str, denial: Denial) -> RateLimitedError:
    charge = denial.charge
    who = f"tenant {tenant!r}" if charge.reason.startswith("tenant") else "all tenants together"
    words = _METRIC_WORDS[charge.metric]
    if denial.retry_after_s is None:
        message = (
            f"the request needs {charge.cost} tokens (prompt plus max output tokens), over the limit of "
            f"{charge.limit} {words} for {who}: it can never be admitted; ask for fewer output tokens"
        )
        return RateLimitedError(message, WINDOW_S, metric=charge.metric, reason=charge.reason)
    retry_after_s = max(1, math.ceil(denial.retry_after_s))
    message = (
        f"rate limit reached for {who} on {words}: limit {charge.limit}, in use {denial.in_use}, "
        f"requested {charge.cost}; retry after {retry_after_s} s"
    )
    return RateLimitedError(message, retry_after_s, metric=charge.metric, reason=charge.reason)
