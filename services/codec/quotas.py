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

The window is a sliding minute, approximated from two fixed one-minute buckets (the standard
"sliding window counter"): with `f` the elapsed fraction of the current bucket,

    in use = previous bucket × (1 − f) + current bucket

so a burst at a bucket boundary cannot get twice the limit, and no per-request log is kept (each
counter is three numbers). Retry-After is computed from the same formula: the time until the previous
bucket has decayed enough, or, when the current bucket alone is too full, until it becomes the
previous one and decays enough. A settlement corrects the bucket its reservation was charged to (if
that bucket is still one of the two; an older one no longer counts anyway).

Two stores implement this: `MemoryQuotaStore` (one codec process) and `RedisQuotaStore` (shared by
codec replicas): one Lua script does check-and-charge over all counters atomically, with Redis's own
clock (`TIME`), so replicas with skewed clocks agree. Each counter is one hash `{b, c, p}` (bucket
index, current, previous) that expires after two windows. All keys carry one hash tag, so the script
also runs on a Redis Cluster (every counter on one shard).

`Quotas` applies the configuration on top of a store, counts refusals, and follows `quotas.fail_open`
when the store cannot be reached: admit unchecked (fail open) or refuse with 503 (fail closed), both
logged and counted.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.codec.limits_errors import QuotaMetric, QuotaUnavailableError, RateLimitedError
from services.codec.limits_metrics import LimitsMetrics
from services.common.config import QuotasConfig

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
DEFAULT_KEY_PREFIX = "{kvrelay-quota}:"  # the braces are a Redis Cluster hash tag: one slot for all
STORE_TIMEOUT_S = 0.5  # connect and command timeout: a Redis that does not answer is down
STORE_RETRY_INTERVAL_S = 1.0  # after a failure, the store is not tried again for this long
DOWN_LOG_INTERVAL_S = 10.0


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


def _settle_deltas(reservation: Reservation, actual_tokens: int) -> list[tuple[str, int]]:
    delta = actual_tokens - reservation.num_tokens
    return [(c.counter, delta) for c in reservation.charges if c.metric == "tokens" and delta]


def _release_deltas(reservation: Reservation) -> list[tuple[str, int]]:
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
        self._adjust(reservation.bucket, _settle_deltas(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        self._adjust(reservation.bucket, _release_deltas(reservation))

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


# KEYS: one hash per counter, fields b (bucket index), c (current bucket), p (previous bucket).
# ARGV[1]: "reserve" | "adjust" | "peek"; ARGV[2]: the bucket length in ms.
#   reserve  ARGV[3..]: limit, cost per key. Charges every key and returns {1, bucket} if each has
#            room, else charges none and returns {0, wait_ms, i} for the key i needing the longest
#            wait (wait_ms -1: its cost alone is over its limit), plus its usage now.
#   adjust   ARGV[3]: the reservation's bucket; ARGV[4..]: a delta per key, applied to that bucket
#            (the current or, once the window moved on, the previous one); counts never go below 0.
#   peek     returns {current, previous} of KEYS[1] as of now.
QUOTA_SCRIPT = """
local mode = ARGV[1]
local window = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local bucket = math.floor(now / window)
local elapsed = (now - bucket * window) / window

local function rolled(key)
  local v = redis.call('HMGET', key, 'b', 'c', 'p')
  local b = tonumber(v[1])
  if b == nil then return 0, 0 end
  local c, p = tonumber(v[2]) or 0, tonumber(v[3]) or 0
  if b >= bucket then return c, p end
  if b == bucket - 1 then return 0, c end
  return 0, 0
end

local function wait_ms(limit, cost, c, p)
  if cost > limit then return -1 end
  if c + cost <= limit then
    local needed = elapsed
    if p > 0 then needed = 1 - (limit - c - cost) / p end
    return math.ceil(math.max(0, needed - elapsed) * window)
  end
  local needed_next = 0
  if c > 0 then needed_next = math.max(0, 1 - (limit - cost) / c) end
  return math.ceil((1 - elapsed + needed_next) * window)
end

if mode == 'peek' then
  local c, p = rolled(KEYS[1])
  return {c, p}
end

if mode == 'adjust' then
  local at = tonumber(ARGV[3])
  for i, key in ipairs(KEYS) do
    local delta = tonumber(ARGV[3 + i])
    local v = redis.call('HMGET', key, 'b', 'c', 'p')
    local b = tonumber(v[1])
    if b ~= nil and delta ~= 0 then
      if b == at then
        redis.call('HSET', key, 'c', math.max(0, (tonumber(v[2]) or 0) + delta))
      elseif b == at + 1 then
        redis.call('HSET', key, 'p', math.max(0, (tonumber(v[3]) or 0) + delta))
      end
    end
  end
  return {1}
end

local counts = {}
local worst, worst_i, worst_use = -2, 0, 0
for i, key in ipairs(KEYS) do
  local limit, cost = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local c, p = rolled(key)
  counts[i] = {c, p, cost}
  local in_use = p * (1 - elapsed) + c
  if in_use + cost > limit then
    local w = wait_ms(limit, cost, c, p)
    if w < 0 then return {0, -1, i, math.ceil(in_use)} end
    if w > worst then worst, worst_i, worst_use = w, i, math.ceil(in_use) end
  end
end
if worst_i > 0 then return {0, worst, worst_i, worst_use} end
for i, key in ipairs(KEYS) do
  redis.call('HSET', key, 'b', bucket, 'c', counts[i][1] + counts[i][3], 'p', counts[i][2])
  redis.call('PEXPIRE', key, 2 * window)
end
return {1, bucket}
"""


class RedisQuotaStore:
    """Counters in Redis, shared by codec replicas. Owns its client: `aclose` closes it.

    A failed call (connection refused, timeout, any Redis error) raises QuotaStoreUnavailableError, and
    for `retry_interval_s` afterwards calls fail at once without trying, so a dead Redis costs one
    timeout per interval, not one per request."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        window_s: float = WINDOW_S,
        retry_interval_s: float = STORE_RETRY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._script = client.register_script(QUOTA_SCRIPT)
        self.key_prefix = key_prefix
        self._window_ms = max(1, round(window_s * 1000))
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_until = -math.inf

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        window_s: float = WINDOW_S,
        timeout_s: float = STORE_TIMEOUT_S,
        retry_interval_s: float = STORE_RETRY_INTERVAL_S,
    ) -> RedisQuotaStore:
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),  # one retry covers a pooled connection Redis dropped; no more
        )
        return cls(client, key_prefix=key_prefix, window_s=window_s, retry_interval_s=retry_interval_s)

    def key(self, counter: str) -> str:
        return f"{self.key_prefix}{counter}"

    async def _call(self, keys: Sequence[str], args: Sequence[str | int]) -> list[int]:
        if self._clock() < self._down_until:
            raise QuotaStoreUnavailableError("the quota store failed recently; not retried yet")
        try:
            result = await self._script(keys=[self.key(k) for k in keys], args=[*args])
        except (RedisError, OSError) as exc:
            self._down_until = self._clock() + self._retry_interval_s
            raise QuotaStoreUnavailableError(f"{type(exc).__name__}: {exc}") from exc
        return [int(x) for x in result]

    async def reserve(self, tenant: str, charges: Sequence[Charge], num_tokens: int) -> Reservation | Denial:
        if not charges:
            return Reservation(tenant, (), 0, num_tokens)
        args: list[str | int] = ["reserve", self._window_ms]
        for charge in charges:
            args += [charge.limit, charge.cost]
        result = await self._call([c.counter for c in charges], args)
        if result[0] == 1:
            return Reservation(tenant, tuple(charges), result[1], num_tokens)
        wait_ms, index, in_use = result[1], result[2], result[3]
        retry_after_s = None if wait_ms < 0 else wait_ms / 1000.0
        return Denial(charges[index - 1], in_use, retry_after_s)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        await self._adjust(reservation.bucket, _settle_deltas(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        await self._adjust(reservation.bucket, _release_deltas(reservation))

    async def _adjust(self, bucket: int, deltas: Sequence[tuple[str, int]]) -> None:
        if deltas:
            args: list[str | int] = ["adjust", self._window_ms, bucket, *(d for _, d in deltas)]
            await self._call([name for name, _ in deltas], args)

    async def usage(self, counter: str) -> tuple[int, int]:
        current, previous = await self._call([counter], ["peek", self._window_ms])
        return current, previous

    async def aclose(self) -> None:
        await self._client.aclose()


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

    @classmethod
    def from_config(cls, config: QuotasConfig, metrics: LimitsMetrics, *, key_prefix: str) -> Quotas:
        store: QuotaStore
        if config.backend == "redis":
            store = RedisQuotaStore.from_url(config.redis_url, key_prefix=key_prefix)
        else:
            store = MemoryQuotaStore()
        return cls(config, store, metrics)

    def charges(self, tenant: str, num_tokens: int) -> tuple[Charge, ...]:
        """The counters a request of `tenant` costing `num_tokens` is charged to (set limits only)."""
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
            if limit is not None
        )

    async def reserve(self, tenant: str, num_tokens: int) -> Reservation:
        """The tenant's reservation, or RateLimitedError (429) / QuotaUnavailableError (503, fail closed)."""
        charges = self.charges(tenant, num_tokens)
        if not charges:
            return self._opened(Reservation(tenant, (), 0, num_tokens))
        try:
            with anyio.CancelScope(shield=True):  # once sent, the answer must be known to be undone
                outcome = await self.store.reserve(tenant, charges, num_tokens)
        except QuotaStoreUnavailableError as exc:
            return self._opened(self._store_down(tenant, num_tokens, exc))
        self._store_up()
        if isinstance(outcome, Denial):
            self._metrics.reject(tenant, outcome.charge.reason)
            raise _rate_limited(tenant, outcome)
        return self._opened(outcome)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Corrects the tokens counters to what was used. Never raises (it runs in cleanup)."""
        self._closed(reservation)
        await self._adjust("settle", reservation, lambda: self.store.settle(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        """Gives the whole reservation back. Never raises (it runs in cleanup)."""
        self._closed(reservation)
        await self._adjust("release", reservation, lambda: self.store.release(reservation))

    async def aclose(self) -> None:
        await self.store.aclose()

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

    def _store_down(self, tenant: str, num_tokens: int, exc: Exception) -> Reservation:
        if self._store_down_since is None:
            self._store_down_since = self._clock()
        if self._config.fail_open:
            self._metrics.store_errors.labels(operation="reserve", outcome="admitted").inc()
            self._log_down(f"quota store unreachable, admitting without quotas (fail open): {exc}")
            return Reservation(tenant, (), 0, num_tokens)
        self._metrics.store_errors.labels(operation="reserve", outcome="refused").inc()
        self._metrics.reject(tenant, "quota_store_down")
        self._log_down(f"quota store unreachable, refusing requests (fail closed): {exc}")
        raise QuotaUnavailableError(
            "quotas cannot be checked now (the quota store is unreachable); retry later"
        )

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
