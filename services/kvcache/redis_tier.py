"""The shared tier's default backend: a Redis of its own role, across every replica.

Never the Redis that holds quotas and stored Responses: this one is a cache, run with `allkeys-lru`, a
`maxmemory` and persistence off (docs/architecture.md, "Redis roles"), so under pressure it drops the least
recently used segments and nothing else. `put` is `SET NX EX ttl` (content-addressed values: the first
writer wins, later ones have nothing to add but a longer lifetime); a hit extends its segment's lifetime
to the tier's `ttl_s`. Lifetimes only grow: a write asking for longer than a segment has left (a client's
`cache_control` ttl, `prompt_cache_retention: "24h"`) extends it, and no hit or write shortens it.
Every call has the client's socket timeout: a Redis that accepts connections but never answers costs at
most that, and raises TierUnavailable like one that is down.

Per-tenant byte caps (`tenant_capacity_bytes`): each tenant tag (the key's third field) gets an index of
its segments by last use (a sorted set), their sizes (a hash) and its byte count, under
`kv1-tenant:<tag>:*`. A put that takes a tenant past its cap removes that tenant's least recently used
segments, and only its own, in the same Lua script (atomic, one round trip); a hit moves its segment to
the end. The count can only overstate: a segment the Redis expired or evicted by itself is still counted
until the tenant's own evictions reach it, so a tenant never holds more than its cap through this tier. The
script touches keys it does not declare, so this backend wants a single Redis, not a Redis Cluster.
"""

from __future__ import annotations

import time
from collections import deque

import redis

from services.common import redis_url
from services.kvcache.segment import tenant_of
from services.kvcache.tier import EVICTED_KEPT, TierUnavailable

TENANT_PREFIX = "kv1-tenant"

_FAILURES = (redis.RedisError, OSError)


# Extends KEYS[i]'s lifetime to ARGV[ttl] seconds unless it has that much left already.
_EXTEND = """
local function extend(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
"""

# KEYS: the segment. ARGV: ttl. Returns the value, its lifetime extended to ttl, or nil.
_GET = (
    _EXTEND
    + """
local value = redis.call('GET', KEYS[1])
if value then extend(KEYS[1], ARGV[1]) end
return value
"""
)

# KEYS: the segment, the tenant's index. ARGV: ttl, now. GET, then the tenant's most recent use.
_GET_CAPPED = (
    _EXTEND
    + """
local value = redis.call('GET', KEYS[1])
if value then
  extend(KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], 'XX', ARGV[2], KEYS[1])
end
return value
"""
)

# KEYS: the segment. ARGV: value, ttl. Returns 1 if stored; an existing value's lifetime is extended.
_PUT = (
    _EXTEND
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end
extend(KEYS[1], ARGV[2])
return 0
"""
)

# KEYS: the segment, the tenant's index, sizes and byte count. ARGV: value, ttl, cap, now.
# Returns {stored (0/1), {the keys of the segments evicted}}.
_PUT_CAPPED = (
    _EXTEND
    + """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  extend(KEYS[1], ARGV[2])
  for i = 2, 4 do extend(KEYS[i], ARGV[2]) end
  return {0, {}}
end
local size = string.len(ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[4], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
local used = redis.call('INCRBY', KEYS[4], size)
local evicted = {}
while used > tonumber(ARGV[3]) do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  local n = tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('HDEL', KEYS[3], oldest[1])
  redis.call('UNLINK', oldest[1])
  used = redis.call('DECRBY', KEYS[4], n)
  table.insert(evicted, oldest[1])
end
for i = 2, 4 do extend(KEYS[i], ARGV[2]) end
return {1, evicted}
"""
)

# KEYS: the segment, the tenant's index, sizes and byte count.
_DELETE_CAPPED = """
local n = tonumber(redis.call('HGET', KEYS[3], KEYS[1]) or '0')
redis.call('UNLINK', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
if n > 0 then redis.call('DECRBY', KEYS[4], n) end
return n
"""


class RedisTier:
    name = "shared"
    outlives_worker = True

    def __init__(self, client: redis.Redis, ttl_s: int, tenant_capacity_bytes: int = 0) -> None:
        """`tenant_capacity_bytes`: each tenant's most bytes here (0: no cap, the Redis's LRU alone)."""
        self.client = client
        self.ttl_s = ttl_s
        self.tenant_capacity_bytes = tenant_capacity_bytes
        self.evictions = (
            0  # segments removed for a tenant's cap; the Redis's own LRU evictions are its INFO's
        )
        self._evicted: deque[str] = deque(maxlen=EVICTED_KEPT)  # keys removed for a tenant's cap
        self._get = client.register_script(_GET)
        self._get_capped = client.register_script(_GET_CAPPED)
        self._put = client.register_script(_PUT)
        self._put_capped = client.register_script(_PUT_CAPPED)
        self._delete_capped = client.register_script(_DELETE_CAPPED)

    @classmethod
    def from_url(
        cls,
        url: str,
        ttl_s: int,
        timeout_s: float,
        password: str | None = None,
        tenant_capacity_bytes: int = 0,
    ) -> RedisTier:
        """A client for `url` (redis://, rediss:// for TLS, or redis+sentinel://: common/redis_url.py)
        whose every call gives up after `timeout_s`."""
        client = redis_url.sync_client(
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        return cls(client, ttl_s, tenant_capacity_bytes)

    def get(self, key: str) -> bytes | None:
        try:
            if not self.tenant_capacity_bytes:
                value = self._get(keys=[key], args=[self.ttl_s])
            else:  # one round trip: the value, its lifetime, and the tenant's most recent use
                value = self._get_capped(keys=[key, tenant_keys(key)[0]], args=[self.ttl_s, time.time()])
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc
        return value if isinstance(value, bytes) else None

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        ttl = max(self.ttl_s, ttl_s or 0)
        try:
            if not self.tenant_capacity_bytes:
                return bool(self._put(keys=[key], args=[value, ttl]))
            keys = [key, *tenant_keys(key)]
            stored, evicted = self._put_capped(
                keys=keys, args=[value, ttl, self.tenant_capacity_bytes, time.time()]
            )
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc
        self.evictions += len(evicted)
        self._evicted.extend(key.decode() for key in evicted)
        return bool(stored)

    def tenant_bytes(self, tag: str) -> int:
        """The bytes counted against tenant `tag`'s cap (0 without caps)."""
        try:
            return int(self.client.get(f"{TENANT_PREFIX}:{tag}:bytes") or 0)
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc

    def contains(self, keys: list[str]) -> list[bool]:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(found) for found in pipe.execute()]
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            if self.tenant_capacity_bytes:
                self._delete_capped(keys=[key, *tenant_keys(key)])
            else:
                self.client.unlink(key)
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc

    def used_bytes(self) -> int | None:
        return None  # the Redis's INFO memory has it; not asked on a scrape

    def take_evicted(self) -> list[str]:
        """The segments removed for tenants' caps (the Redis's own LRU and TTL removals are not seen)."""
        keys = []
        while self._evicted:
            keys.append(self._evicted.popleft())
        return keys

    def close(self) -> None:
        self.client.close()


def tenant_keys(key: str) -> list[str]:
    """The index (sorted set), sizes (hash) and byte count of the tenant `key` belongs to."""
    prefix = f"{TENANT_PREFIX}:{tenant_of(key)}"
    return [f"{prefix}:index", f"{prefix}:sizes", f"{prefix}:bytes"]
