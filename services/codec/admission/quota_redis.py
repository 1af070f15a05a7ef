"""The quota store shared by codec replicas: counters in Redis, checked and charged by one Lua script.

One script does check-and-charge over all counters atomically, with Redis's own clock (`TIME`), so
replicas with skewed clocks agree. Each counter is one hash `{b, c, p}` (bucket index, current,
previous) that expires after two windows. All keys carry one hash tag, so the script also runs on a
Redis Cluster (every counter on one shard). A Redis that does not answer within STORE_TIMEOUT_S is
down (QuotaStoreUnavailableError; quotas.py decides what that means). Each codec replica also beats
into one sorted set (`heartbeat`), so every replica knows how many share the limits: quotas.py divides
them by that count when Redis goes down and quotas fail open.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from services.codec.admission.quota_store import (
    WINDOW_S,
    Charge,
    Denial,
    QuotaStoreUnavailableError,
    Reservation,
    release_deltas,
    settle_deltas,
)
from services.common import redis_url

DEFAULT_KEY_PREFIX = "{kvrelay-quota}:"  # the braces are a Redis Cluster hash tag: one slot for all
STORE_TIMEOUT_S = 0.5  # connect and command timeout: a Redis that does not answer is down
STORE_RETRY_INTERVAL_S = 1.0  # after a failure, the store is not tried again for this long


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


# KEYS[1]: the sorted set of live codec replicas. ARGV[1]: this replica's ID, ARGV[2]: how long (ms) a
# replica counts as alive after its last beat. Returns how many are alive, this one included.
HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])
"""
REPLICAS_KEY = "codecs"


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
        self._heartbeat = client.register_script(HEARTBEAT_SCRIPT)
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
        client = redis_url.async_client(
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
        await self._adjust(reservation.bucket, settle_deltas(reservation, actual_tokens))

    async def release(self, reservation: Reservation) -> None:
        await self._adjust(reservation.bucket, release_deltas(reservation))

    async def _adjust(self, bucket: int, deltas: Sequence[tuple[str, int]]) -> None:
        if deltas:
            args: list[str | int] = ["adjust", self._window_ms, bucket, *(d for _, d in deltas)]
            await self._call([name for name, _ in deltas], args)

    async def heartbeat(self, replica_id: str, alive_s: float) -> int:
        """Marks this codec replica alive; how many replicas beat within the last `alive_s`."""
        if self._clock() < self._down_until:
            raise QuotaStoreUnavailableError("the quota store failed recently; not retried yet")
        try:
            alive = await self._heartbeat(
                keys=[self.key(REPLICAS_KEY)], args=[replica_id, round(alive_s * 1000)]
            )
        except (RedisError, OSError) as exc:
            self._down_until = self._clock() + self._retry_interval_s
            raise QuotaStoreUnavailableError(f"{type(exc).__name__}: {exc}") from exc
        return int(alive)

    async def usage(self, counter: str) -> tuple[int, int]:
        current, previous = await self._call([counter], ["peek", self._window_ms])
        return current, previous

    async def aclose(self) -> None:
        await self._client.aclose()
