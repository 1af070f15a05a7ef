"""The shared tier's default backend: a Redis of its own role, across every replica.

Never the Redis that holds quotas and stored Responses: this one is a cache, run with `allkeys-lru`, a
`maxmemory` and persistence off (docs/architecture.md, "Redis roles"), so under pressure it drops the least
recently used segments and nothing else. `put` is `SET NX EX ttl` (content-addressed values: the first
writer wins, later ones have nothing to add); `get` is `GETEX ... EX ttl`, so a hit keeps its segment alive.
Every call has the client's socket timeout: a Redis that accepts connections but never answers costs at
most that, and raises TierUnavailable like one that is down.
"""

from __future__ import annotations

import redis

from services.kvcache.tier import TierUnavailable

_FAILURES = (redis.RedisError, OSError)


class RedisTier:
    name = "shared"
    evictions = 0  # the Redis evicts by itself (allkeys-lru): its INFO stats count them

    def __init__(self, client: redis.Redis, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, ttl_s: int, timeout_s: float, password: str | None = None) -> RedisTier:
        """A client for `url` (redis:// or rediss:// for TLS) whose every call gives up after `timeout_s`."""
        client = redis.Redis.from_url(
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        return cls(client, ttl_s)

    def get(self, key: str) -> bytes | None:
        try:
            value = self.client.getex(key, ex=self.ttl_s)
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc
        return value if isinstance(value, bytes) else None

    def put(self, key: str, value: bytes) -> bool:
        try:
            return bool(self.client.set(key, value, nx=True, ex=self.ttl_s))
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
            self.client.unlink(key)
        except _FAILURES as exc:
            raise TierUnavailable(f"shared tier: {exc}") from exc

    def used_bytes(self) -> int | None:
        return None  # the Redis's INFO memory has it; not asked on a scrape

    def close(self) -> None:
        self.client.close()
