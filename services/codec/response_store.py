"""Stored Responses: what `GET /v1/responses/{id}` returns and what `previous_response_id` continues.

Each record is scoped to a tenant: a record put by one tenant is invisible (`None`) to every other.
Two implementations of one interface:

- `InMemoryResponseStore`: one codec process; entries expire after `ttl_s` and the oldest are evicted
  past `max_entries`, so memory stays bounded.
- `RedisResponseStore`: shared by every codec replica, so a conversation can continue on any of them.
  One string key per record, `<key_prefix><tenant>:<response_id>`, written with a TTL of `ttl_s`.

`store_from_env` picks one: Redis when `KVRELAY_RESPONSES_REDIS_URL` is set (e.g.
`redis://127.0.0.1:6379/0`), else in memory. It is read once, when the app is built.
"""

from __future__ import annotations

import abc
import json
import re
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

REDIS_URL_ENV = "KVRELAY_RESPONSES_REDIS_URL"
DEFAULT_TTL_S = 30 * 24 * 3600  # OpenAI keeps stored responses for 30 days
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_KEY_PREFIX = "kvrelay:responses:"
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    `body` is the response object as served. `conversation` is what a continuation starts from: the
    earlier turns, this response's input and its output, as chat-template messages (instructions are
    never part of it).
    """

    response_id: str
    body: dict[str, Any]
    conversation: list[dict[str, str]]

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
    """Records in this process only, oldest first; expired entries are dropped when met."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, tenant: str, record: StoredResponse) -> None:
        key = (tenant, record.response_id)
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + self._ttl_s, record)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((tenant, response_id))
        if entry is None:
            return None
        expires_at, record = entry
        if self._clock() >= expires_at:
            del self._entries[(tenant, response_id)]
            return None
        return record

    async def delete(self, tenant: str, response_id: str) -> bool:
        is_live = await self.get(tenant, response_id) is not None
        self._entries.pop((tenant, response_id), None)
        return is_live

    async def aclose(self) -> None:
        self._entries.clear()


class RedisResponseStore(ResponseStore):
    """Records in Redis with a TTL. The client is owned: `aclose` closes it."""

    def __init__(
        self, client: aioredis.Redis, *, ttl_s: int = DEFAULT_TTL_S, key_prefix: str = DEFAULT_KEY_PREFIX
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._key_prefix = key_prefix

    @classmethod
    def from_url(
        cls, url: str, *, ttl_s: int = DEFAULT_TTL_S, key_prefix: str = DEFAULT_KEY_PREFIX
    ) -> RedisResponseStore:
        return cls(aioredis.Redis.from_url(url, decode_responses=True), ttl_s=ttl_s, key_prefix=key_prefix)

    def key(self, tenant: str, response_id: str) -> str:
        """The tenant is quoted so that no (tenant, ID) pair can spell another tenant's key."""
        return f"{self._key_prefix}{urllib.parse.quote(tenant, safe='')}:{response_id}"

    async def put(self, tenant: str, record: StoredResponse) -> None:
        await self._client.set(self.key(tenant, record.response_id), record.to_json(), ex=self._ttl_s)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not is_response_id(response_id):
            return None
        text = await self._client.get(self.key(tenant, response_id))
        return None if text is None else StoredResponse.from_json(text)

    async def delete(self, tenant: str, response_id: str) -> bool:
        if not is_response_id(response_id):
            return False
        return bool(await self._client.delete(self.key(tenant, response_id)))

    async def aclose(self) -> None:
        await self._client.aclose()


def store_from_env(environ: Mapping[str, str]) -> ResponseStore:
    """Redis at `KVRELAY_RESPONSES_REDIS_URL` when it is set, else an in-memory store."""
    url = environ.get(REDIS_URL_ENV, "").strip()
    return RedisResponseStore.from_url(url) if url else InMemoryResponseStore()
