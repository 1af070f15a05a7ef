"""Stored Responses: what `GET /v1/responses/{id}` returns and what `previous_response_id` continues.

Each record is scoped to a tenant: a record put by one tenant is invisible (`None`) to every other.
Each tenant holds at most `responses.max_per_tenant` records and `responses.max_bytes_per_tenant` bytes
of them: past either, its oldest records are dropped, so one tenant cannot fill the store. Two
implementations of one interface:

- `InMemoryResponseStore`: one codec process; entries expire after `ttl_s`.
- `RedisResponseStore`: shared by every codec replica, so a conversation can continue on any of them.
  One string key per record, `<key_prefix><tenant>:<response_id>`, written with a TTL of `ttl_s`, and
  per tenant an index (a sorted set by time, `<key_prefix><tenant>:index`) and a byte total
  (`:bytes`) that one Lua script keeps in step with the records. Its client has socket timeouts
  (`responses.socket_timeout_ms`), so a Redis that stops answering costs a request at most that long;
  any Redis failure is `ResponseStoreUnavailableError` (a 503 where a stored record is needed).

`store_from_config` picks one: Redis when `responses.redis_url` is set (its own database, e.g.
`redis://127.0.0.1:6379/1`; the older `KVRELAY_RESPONSES_REDIS_URL` is still read), else in memory.
"""

from __future__ import annotations

import abc
import json
import re
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.codec.errors import StoreUnavailableError
from services.common import redis_url
from services.common.config import ResponsesConfig

REDIS_URL_ENV = "KVRELAY_RESPONSES_REDIS_URL"  # before responses.redis_url existed; still read
DEFAULT_TTL_S = 30 * 24 * 3600  # OpenAI keeps stored responses for 30 days
DEFAULT_MAX_ENTRIES = 10_000  # per tenant
DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # per tenant
DEFAULT_KEY_PREFIX = "kvrelay:responses:"
DEFAULT_SOCKET_TIMEOUT_S = 1.0
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


class ResponseStoreUnavailableError(StoreUnavailableError):
    """The store (Redis) did not answer: a 503 where a stored record is needed; logged and counted
    where one was only to be kept."""

    what = "stored responses are"


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    `body` is the response object as served. `conversation` is what a continuation starts from: the
    earlier turns, this response's input and its output, as chat-template messages (instructions are
    never part of it): an assistant turn may hold `tool_calls`, and a `tool` turn answers one of them.
    """

    response_id: str
    body: dict[str, Any]
    conversation: list[dict[str, Any]]

    def to_json(self) -> str:
        record = {"response_id": self.response_id, "body": self.body, "conversation": self.conversation}
        return json.dumps(record, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        record = json.loads(text)
        return cls(record["response_id"], record["body"], record["conversation"])


def is_response_id(value: str) -> bool:
    """Whether `value` has the shape of an ID this server hands out (others are never stored)."""
    return _RESPONSE_ID.fullmatch(value) is not None


class ResponseStore(abc.ABC):
    """Stored responses, keyed by (tenant, response ID)."""

    @abc.abstractmethod
    async def put(self, tenant: str, record: StoredResponse) -> None:
        """Stores `record` for `tenant`, replacing any record with the same ID."""

    @abc.abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The record `tenant` stored under `response_id`, or None (unknown, expired or another tenant's)."""

    @abc.abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool:
        """Removes the record; False when `tenant` had none under `response_id`."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Releases connections. The store is not used afterwards."""


class InMemoryResponseStore(ResponseStore):
    """Records in this process only, oldest first per tenant; expired entries are dropped when met."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._clock = clock
        # tenant -> response ID -> (expires at, size, record), oldest first
        self._tenants: dict[str, OrderedDict[str, tuple[float, int, StoredResponse]]] = {}
        self._bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._tenants.values())

    async def put(self, tenant: str, record: StoredResponse) -> None:
        self._drop(tenant, record.response_id)
        entries = self._tenants.setdefault(tenant, OrderedDict())
        size = len(record.to_json().encode())
        entries[record.response_id] = (self._clock() + self._ttl_s, size, record)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while tenant in self._tenants and (
            len(entries) > self._max_entries or self._bytes[tenant] > self._max_bytes
        ):
            self._drop(tenant, next(iter(entries)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entries = self._tenants.get(tenant)
        entry = entries.get(response_id) if entries is not None else None
        if entry is None:
            return None
        expires_at, _, record = entry
        if self._clock() >= expires_at:
            self._drop(tenant, response_id)
            return None
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        is_live = await self.get(tenant, response_id) is not None
        self._drop(tenant, response_id)
        return is_live

    def _drop(self, tenant: str, response_id: str) -> None:
        entries = self._tenants.get(tenant)
        entry = entries.pop(response_id, None) if entries is not None else None
        if entry is not None:
            self._bytes[tenant] -= entry[1]
        if entries is not None and not entries:
            del self._tenants[tenant]
            self._bytes.pop(tenant, None)

    async def aclose(self) -> None:
        self._tenants.clear()
        self._bytes.clear()


# KEYS[1] the record, KEYS[2] the tenant's index (sorted set: response ID by time written), KEYS[3] its
# byte total, KEYS[4] its sizes (hash: response ID -> bytes). ARGV: response ID, record JSON, TTL s,
# max records, max bytes, record-key prefix. Drops index entries whose records expired, then the
# oldest records while over either cap. Returns how many records it dropped.
PUT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, ttl, prefix = ARGV[1], tonumber(ARGV[3]), ARGV[6]
local max_n, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local function drop(old)
  local size = tonumber(redis.call('HGET', KEYS[4], old) or '0')
  redis.call('ZREM', KEYS[2], old)
  redis.call('HDEL', KEYS[4], old)
  redis.call('DECRBY', KEYS[3], size)
  redis.call('DEL', prefix .. old)
end
drop(id)
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000)) do drop(old) end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
if last and tonumber(last) >= now then now = tonumber(last) + 1 end  -- strictly in write order
redis.call('ZADD', KEYS[2], now, id)
redis.call('HSET', KEYS[4], id, string.len(ARGV[2]))
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[2]))
local dropped = 0
while redis.call('ZCARD', KEYS[2]) > max_n or total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then  -- the total outlived its index (an LRU Redis evicts keys one by one): start over
    redis.call('SET', KEYS[3], 0)
    break
  end
  drop(oldest)
  dropped = dropped + 1
  total = tonumber(redis.call('GET', KEYS[3]) or '0')
end
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
return dropped
"""

# KEYS as PUT_SCRIPT's; ARGV[1] the response ID. Returns 1 when the record existed.
DELETE_SCRIPT = """
local size = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('DECRBY', KEYS[3], size)
return redis.call('DEL', KEYS[1])
"""


class RedisResponseStore(ResponseStore):
    """Records in Redis with a TTL and per-tenant caps. The client is owned: `aclose` closes it."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._key_prefix = key_prefix
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._put = client.register_script(PUT_SCRIPT)
        self._delete = client.register_script(DELETE_SCRIPT)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> RedisResponseStore:
        client = redis_url.async_client(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(client, ttl_s=ttl_s, key_prefix=key_prefix, max_entries=max_entries, max_bytes=max_bytes)

    def key(self, tenant: str, response_id: str) -> str:
        """The tenant is quoted so that no (tenant, ID) pair can spell another tenant's key."""
        return f"{self._tenant_prefix(tenant)}{response_id}"

    def _tenant_prefix(self, tenant: str) -> str:
        return f"{self._key_prefix}{urllib.parse.quote(tenant, safe='')}:"

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        tenant_prefix = self._tenant_prefix(tenant)
        suffixes = ("index", "bytes", "sizes")  # never a response ID: those start with resp_
        return [self.key(tenant, response_id), *(f"{tenant_prefix}{suffix}" for suffix in suffixes)]

    async def put(self, tenant: str, record: StoredResponse) -> None:
        args: list[str | int] = [record.response_id, record.to_json(), self._ttl_s, self._max_entries]
        args += [self._max_bytes, self._tenant_prefix(tenant)]
        keys = self._keys(tenant, record.response_id)
        async with _unavailable_on_failure():
            await self._put(keys=keys, args=args)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not is_response_id(response_id):
            return None
        async with _unavailable_on_failure():
            text = await self._client.get(self.key(tenant, response_id))
        return None if text is None else StoredResponse.from_json(text)

    async def delete(self, tenant: str, response_id: str) -> bool:
        if not is_response_id(response_id):
            return False
        async with _unavailable_on_failure():
            return bool(await self._delete(keys=self._keys(tenant, response_id), args=[response_id]))

    async def aclose(self) -> None:
        await self._client.aclose()


@asynccontextmanager
async def _unavailable_on_failure() -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise ResponseStoreUnavailableError(
            f"the stored-Responses store failed: {type(exc).__name__}"
        ) from exc


def store_from_config(config: ResponsesConfig, environ: Mapping[str, str]) -> ResponseStore:
    """Redis at `responses.redis_url` (else the older KVRELAY_RESPONSES_REDIS_URL) when set, else memory."""
    url = config.redis_url or environ.get(REDIS_URL_ENV, "").strip()
    max_entries, max_bytes = config.max_per_tenant, config.max_bytes_per_tenant
    if not url:
        return InMemoryResponseStore(ttl_s=config.ttl_s, max_entries=max_entries, max_bytes=max_bytes)
    return RedisResponseStore.from_url(
        url,
        ttl_s=config.ttl_s,
        key_prefix=config.key_prefix,
        timeout_s=config.socket_timeout_ms / 1000,
        max_entries=max_entries,
        max_bytes=max_bytes,
    )
