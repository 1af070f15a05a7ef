"""The exact-result cache's store and replay (docs/result-cache.md): a finished generation's token deltas,
kept in the shared cache tier's Redis under the request's result key (protocols/result_key.py), and
replayed to a later request with the same key instead of calling the backend.

- Off unless `result_cache.url` (else `kv_tiers.shared_url`) names a Redis: `ResultCache.from_config`
  gives None, and nothing asks for a key.
- A request uses it when it asks (`x-kvrelay-result-cache: use`), its tenant is listed in
  `result_cache.tenants` ("*": every tenant) and it is greedy or seeded (`is_replayable`); an unseeded
  sampled request never is, its output is meant to vary.
- `lookup` is a miss when the store fails or is slow (`timeout_ms`): generation goes on as without it,
  counted in `kvrelay_codec_result_cache_errors_total`. `store_later` writes in the background, never
  holding the response; a result over `max_entry_bytes` is not stored. Each tenant keeps at most
  `tenant_capacity_mb` of results (its oldest dropped first, as stored Responses are) for `ttl_s`.
- What is stored: each delta's sample index, token IDs, logprobs (with their top alternatives) and finish
  reason, and the prompt's length. A replay gives the same deltas, with the whole prompt counted as
  cached and no cache writes; the codec reads them as it reads the backend's (stop strings, tools,
  reasoning, usage), and the response and tool-call IDs are minted fresh as for any response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.codec.backend.protocol import TokenDelta
from services.codec.metrics import ResultCacheMetrics
from services.codec.response_store import PUT_SCRIPT
from services.common import redis_url
from services.common.config import KV_TIERS_PASSWORD_ENV, KvrelayConfig
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams

log = logging.getLogger(__name__)

REQUEST_HEADER = "x-kvrelay-result-cache"  # "use": this request may be answered from, and stored in, it
RESPONSE_HEADER = "x-kvrelay-result-cache"  # hit, miss, or skip (asked, but not eligible)
RECORD_VERSION = 1
MAX_ENTRIES_PER_TENANT = 1_000_000  # the byte cap binds first


def is_replayable(sampling: SamplingParams) -> bool:
    """Greedy or seeded: the same request computes the same tokens on the same numerics."""
    return sampling.temperature == 0.0 or sampling.seed is not None


class ResultCache:
    def __init__(
        self,
        client: aioredis.Redis,
        metrics: ResultCacheMetrics,
        *,
        tenants: Sequence[str],
        ttl_s: int,
        max_entry_bytes: int,
        tenant_capacity_bytes: int,
        timeout_s: float,
        key_prefix: str,
    ) -> None:
        self._client = client
        self._put = client.register_script(PUT_SCRIPT)
        self.metrics = metrics
        self._tenants = frozenset(tenants)
        self._ttl_s = ttl_s
        self._max_entry_bytes = max_entry_bytes
        self._tenant_capacity_bytes = tenant_capacity_bytes
        self._timeout_s = timeout_s
        self._key_prefix = key_prefix
        self._writes: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(
        cls, config: KvrelayConfig, metrics: ResultCacheMetrics, environ: Mapping[str, str]
    ) -> ResultCache | None:
        """The cache `result_cache` describes, or None (off). In the shared KV tier's Redis (no url of its
        own) it signs in with that tier's password (KVRELAY_KV_TIERS_PASSWORD), as the workers do."""
        settings = config.result_cache
        url = settings.url or config.kv_tiers.shared_url
        if url is None or not settings.tenants:
            return None
        timeout_s = settings.timeout_ms / 1000
        password = None if settings.url else environ.get(KV_TIERS_PASSWORD_ENV)
        client = redis_url.async_client(
            url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(
            client,
            metrics,
            tenants=settings.tenants,
            ttl_s=settings.ttl_s,
            max_entry_bytes=settings.max_entry_bytes,
            tenant_capacity_bytes=settings.tenant_capacity_mb * 2**20,
            timeout_s=timeout_s,
            key_prefix=settings.key_prefix,
        )

    def admits(self, tenant: str) -> bool:
        """Whether `tenant` opted in (result_cache.tenants)."""
        return "*" in self._tenants or tenant in self._tenants

    async def lookup(self, key: str, tenant: str) -> list[TokenDelta] | None:
        """The stored deltas of `key` for `tenant`, or None (a miss, also when the store fails)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                value = await self._client.get(self._key(tenant, key))
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.errors.labels(operation="get").inc()
            log.warning("result cache lookup failed: a miss", extra={"error": type(exc).__name__})
            value = None
        deltas = None if value is None else _decode(value)
        self.metrics.lookups.labels(tenant=tenant, outcome="miss" if deltas is None else "hit").inc()
        if deltas is not None and value is not None:
            self.metrics.bytes.labels(tenant=tenant, direction="read").inc(len(value))
        return deltas

    def store_later(self, key: str, tenant: str, deltas: Sequence[TokenDelta]) -> None:
        """Write the finished generation's deltas in the background (the response never waits on it)."""
        value = _encode(deltas)
        if len(value) > self._max_entry_bytes:
            return
        task = asyncio.get_running_loop().create_task(self._store(key, tenant, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _store(self, key: str, tenant: str, value: bytes) -> None:
        prefix = self._tenant_prefix(tenant)
        keys = [self._key(tenant, key), f"{prefix}index", f"{prefix}bytes", f"{prefix}sizes"]
        args: list[Any] = [
            key,
            value,
            self._ttl_s,
            MAX_ENTRIES_PER_TENANT,
            self._tenant_capacity_bytes,
            prefix,
        ]
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._put(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.errors.labels(operation="put").inc()
            log.warning("result cache write failed: not stored", extra={"error": type(exc).__name__})
            return
        self.metrics.bytes.labels(tenant=tenant, direction="written").inc(len(value))

    async def drain(self) -> None:
        """Wait for the writes under way (tests; shutdown)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def aclose(self) -> None:
        await self.drain()
        await self._client.aclose()

    def _tenant_prefix(self, tenant: str) -> str:
        return f"{self._key_prefix}{urllib.parse.quote(tenant, safe='')}:"

    def _key(self, tenant: str, key: str) -> str:
        return f"{self._tenant_prefix(tenant)}{key}"  # a key is 64 hex digits: never index, bytes or sizes


async def replay(deltas: Sequence[TokenDelta]) -> AsyncIterator[TokenDelta]:
    """The stored deltas as a backend stream: the whole prompt counted as cached, nothing written."""
    for delta in deltas:
        yield TokenDelta(
            delta.index, list(delta.token_ids), list(delta.logprobs), delta.finish_reason,
            delta.num_prompt_tokens, delta.num_prompt_tokens,
        )  # fmt: skip


def _encode(deltas: Sequence[TokenDelta]) -> bytes:
    record = {
        "version": RECORD_VERSION,
        "deltas": [
            [
                d.index,
                d.token_ids,
                [[lp.token_id, lp.logprob, [list(top) for top in lp.top]] for lp in d.logprobs],
                None if d.finish_reason is None else FinishReason(d.finish_reason).value,
                d.num_prompt_tokens,
            ]
            for d in deltas
        ],
    }
    return json.dumps(record, separators=(",", ":")).encode()


def _decode(value: bytes | str) -> list[TokenDelta] | None:
    """The stored deltas; None for a record of another version or shape (read as a miss)."""
    try:
        record = json.loads(value)
        if record.get("version") != RECORD_VERSION:
            return None
        return [
            TokenDelta(
                index,
                list(token_ids),
                [TokenLogprob(t, lp, [(a, b) for a, b in top]) for t, lp, top in logprobs],
                None if reason is None else FinishReason(reason),
                num_prompt,
                num_prompt,
            )
            for index, token_ids, logprobs, reason, num_prompt in record["deltas"]
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
