"""The async lane's durable queue: jobs in Redis Streams on a Redis of the queue role (docs/async.md).

One stream per (served model fingerprint, priority class), `<prefix>jobs:<fingerprint>:<class>`, each
read by the consumer group `drainers`: a drainer takes only the jobs of the model its stack serves, the
high class before the normal one before the low one. Delivery is at least once:

- `take` hands a job to one consumer (XREADGROUP); the job stays pending until `finish`.
- A drainer renews its claim on the jobs it runs (`renew`, XCLAIM JUSTID) well within
  `queue.claim_after_ms`; a job nobody renewed that long (its drainer died) is taken over by the next
  `take` (XAUTOCLAIM), up to `queue.max_attempts` deliveries, after which it is handed out marked
  `exhausted` so its owner can fail it.
- `finish` writes the job's result once: SET NX on `<prefix>result:<job_id>`, then XACK and XDEL, in one
  script. A second finisher (the first was presumed dead, but was not) finds the result written and only
  acknowledges: the result a client reads never changes.

Per tenant, `<prefix>tenant:<tenant>` counts the jobs and tokens enqueued and not finished; `enqueue`
checks them against the caps and adds the job in one script (QueueFullError, a 429). Cancelling a job
sets `<prefix>cancel:<job_id>`: a queued job is finished as cancelled when taken, a running one is
stopped by its drainer, which watches the flag.

The queue Redis must not evict (`maxmemory-policy noeviction`) and should persist (`appendonly yes`): a
job acknowledged at creation is never lost to memory pressure or a restart. `check_server` warns when it
is not so configured. Any Redis failure is QueueUnavailableError (a 503 in the protocol's shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from services.codec.errors import StoreUnavailableError, WireError
from services.common import priority, redis_url
from services.common.errors import KvrelayError

logger = logging.getLogger("kvrelay.queue")

GROUP = "drainers"
CLASSES = (priority.HIGH, priority.NORMAL, priority.LOW)  # taken in this order

# KEYS: tenant hash, stream. ARGV: max jobs (0: none), max tokens (0: none), tokens, then field/value pairs.
_ENQUEUE = """
local jobs = tonumber(redis.call('HGET', KEYS[1], 'jobs') or '0')
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local max_jobs, max_tokens, add = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if max_jobs > 0 and jobs + 1 > max_jobs then return {0, 'jobs', jobs} end
if max_tokens > 0 and tokens + add > max_tokens then return {0, 'tokens', tokens} end
redis.call('HINCRBY', KEYS[1], 'jobs', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', add)
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
return {1, id, 0}
"""

# KEYS: result, stream, tenant hash, cancel flag, then optionally an owner's record and events stream.
# ARGV: result, ttl, group, entry id, tokens, then (with the optional keys) the record and the end mark.
# The result is written once (SET NX); the tenant's counts go down only when this call retires the entry
# (XACK answers 1), so a second finisher, or one after the result was deleted or expired, counts nothing
# twice; the owner's record and end mark go with the first result, in the same script.
_FINISH = """
local first = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', tonumber(ARGV[2]))
local acked = redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[2], ARGV[4])
if acked == 1 then
  redis.call('HINCRBY', KEYS[3], 'jobs', -1)
  redis.call('HINCRBY', KEYS[3], 'tokens', 0 - tonumber(ARGV[5]))  -- never -0, which HINCRBY refuses
  redis.call('DEL', KEYS[4])
end
if first and #KEYS >= 6 then
  if redis.call('EXISTS', KEYS[5]) == 1 then  -- not deleted meanwhile
    redis.call('SET', KEYS[5], ARGV[6], 'EX', tonumber(ARGV[2]))
    redis.call('XADD', KEYS[6], '*', 'end', ARGV[7])
    redis.call('EXPIRE', KEYS[6], tonumber(ARGV[2]))
  end
end
if first then return 1 end
return 0
"""


class QueueUnavailableError(StoreUnavailableError):
    """The queue's Redis did not answer: background work cannot be accepted or read now (503)."""

    what = "the background queue is"


class QueueFullError(KvrelayError):
    """The tenant's queued jobs or tokens would pass its cap (a 429)."""

    def __init__(self, what: str, held: int, cap: int) -> None:
        super().__init__(
            f"too much queued background work for this tenant: {held} {what} queued or running, the cap is "
            f"{cap}; retry once some finish"
        )
        self.what = what

    def wire_error(self) -> WireError:
        return WireError(429, str(self), "rate_limit_error", code="queue_full", headers={"Retry-After": "10"})


@dataclass(frozen=True)
class Job:
    """One unit of queued work. `payload` is the kind's own (a background response: its request body)."""

    job_id: str
    tenant: str
    kind: str
    payload: dict[str, Any]
    priority: int = priority.NORMAL
    num_tokens: int = 0  # what it may cost (prompt + max output): counted against the tenant's cap
    key_id: str | None = None  # the API key that made it (its permissions run with it)
    enqueued_at: float = field(default_factory=time.time)
    # Set once taken: where it sits, and how many times it has been delivered (1 on the first take).
    entry_id: str = ""
    deliveries: int = 0
    exhausted: bool = False  # delivered max_attempts times without finishing: fail it
    uncapped: bool = False  # enqueued past the tenant's caps and counted apart (a batch's line)

    def fields(self) -> dict[str, str]:
        record = {
            "job_id": self.job_id, "tenant": self.tenant, "kind": self.kind, "priority": self.priority,
            "num_tokens": self.num_tokens, "key_id": self.key_id, "enqueued_at": self.enqueued_at,
            "uncapped": self.uncapped,
        }  # fmt: skip
        return {"job": json.dumps(record), "payload": json.dumps(self.payload, separators=(",", ":"))}

    @classmethod
    def from_fields(cls, entry_id: str, fields: dict[str, str], deliveries: int, max_attempts: int) -> Job:
        record = json.loads(fields["job"])
        return cls(
            record["job_id"], record["tenant"], record["kind"], json.loads(fields["payload"]),
            int(record["priority"]), int(record["num_tokens"]), record["key_id"],
            float(record["enqueued_at"]), entry_id, deliveries, deliveries > max_attempts,
            bool(record.get("uncapped", False)),
        )  # fmt: skip


@dataclass(frozen=True)
class ClassStats:
    priority: int
    queued: int  # not yet delivered to any drainer
    running: int  # delivered and not finished
    oldest_age_s: float  # the oldest queued or running job's age; 0 when none


def new_job_id() -> str:
    return uuid.uuid4().hex


class JobQueue:
    """The queue of one served model (`fingerprint`). Every method raises QueueUnavailableError when the
    Redis fails."""

    def __init__(
        self,
        client: aioredis.Redis,
        fingerprint: str,
        *,
        key_prefix: str = "kvrelay:queue:",
        claim_after_s: float = 30.0,
        max_attempts: int = 3,
        result_ttl_s: int = 7 * 24 * 3600,
    ) -> None:
        self.client: Any = client  # redis-py's command typing does not follow decode_responses
        self.fingerprint = fingerprint
        self.prefix = key_prefix
        self.claim_after_ms = int(claim_after_s * 1000)
        self.max_attempts = max_attempts
        self.result_ttl_s = result_ttl_s
        self._enqueue = client.register_script(_ENQUEUE)
        self._finish = client.register_script(_FINISH)
        self._groups_made = False

    @classmethod
    def from_url(cls, url: str, fingerprint: str, socket_timeout_s: float = 2.0, **options: Any) -> JobQueue:
        client = redis_url.async_client(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            decode_responses=True,
        )
        return cls(client, fingerprint, **options)

    # -- keys --------------------------------------------------------------------------------------------

    def stream(self, klass: int) -> str:
        return f"{self.prefix}jobs:{self.fingerprint}:{priority.name_of(klass)}"

    def result_key(self, job_id: str) -> str:
        return f"{self.prefix}result:{job_id}"

    def cancel_key(self, job_id: str) -> str:
        return f"{self.prefix}cancel:{job_id}"

    def tenant_key(self, tenant: str, uncapped: bool = False) -> str:
        """The tenant's queued jobs and tokens: those its caps count, or those enqueued uncapped (batch
        lines), counted apart."""
        return f"{self.prefix}{'uncapped' if uncapped else 'tenant'}:{tenant}"

    # -- producing ---------------------------------------------------------------------------------------

    async def enqueue(self, job: Job, *, max_jobs: int | None, max_tokens: int | None) -> str:
        """Add `job` for a drainer, counted against its tenant's caps; its stream entry ID."""
        args: list[Any] = [max_jobs or 0, max_tokens or 0, job.num_tokens]
        for name, value in job.fields().items():
            args += [name, value]
        async with self.calling("enqueue"):
            added, what, held = await self._enqueue(
                keys=[self.tenant_key(job.tenant), self.stream(job.priority)], args=args
            )
        if not added:
            cap = max_jobs if what == "jobs" else max_tokens
            raise QueueFullError(str(what), int(held), int(cap or 0))
        return str(what)

    async def enqueue_many(self, jobs: list[Job], chunk: int = 1000) -> None:
        """Add `jobs` (a batch's lines, each `uncapped`), `chunk` to a round trip, never refused: a batch is
        capped by its own limits (docs/batches.md). They are counted apart from the tenant's capped jobs, so
        a big batch never holds back a background response."""
        assert all(job.uncapped for job in jobs)
        async with self.calling("enqueue a batch's lines"):
            for start in range(0, len(jobs), chunk):
                pipe = self.client.pipeline(transaction=False)
                for job in jobs[start : start + chunk]:
                    args: list[Any] = [0, 0, job.num_tokens]
                    for name, value in job.fields().items():
                        args += [name, value]
                    await self._enqueue(  # queued on the pipeline (its script loaded at execute)
                        keys=[self.tenant_key(job.tenant, uncapped=True), self.stream(job.priority)],
                        args=args,
                        client=pipe,
                    )
                await pipe.execute()

    async def cancel(self, job_id: str) -> None:
        """Ask for `job_id` to stop: a queued job is finished as cancelled when taken, a running one by its
        drainer (`is_cancelled`)."""
        async with self.calling("cancel"):
            await self.client.set(self.cancel_key(job_id), "1", ex=self.result_ttl_s)

    async def is_cancelled(self, job_id: str) -> bool:
        async with self.calling("read a cancel flag"):
            return bool(await self.client.exists(self.cancel_key(job_id)))

    async def result(self, job_id: str) -> str | None:
        async with self.calling("read a result"):
            value = await self.client.get(self.result_key(job_id))
        return None if value is None else str(value)

    # -- consuming ---------------------------------------------------------------------------------------

    async def take(self, consumer: str, block_ms: int = 0) -> Job | None:
        """The next job for `consumer`: one whose drainer died first (by class), then a queued one (by
        class). Looks again after `block_ms` when there was none (0: not at all). One stream at a time: a
        read across streams would hand this consumer one entry of each."""
        for attempt in range(2 if block_ms > 0 else 1):
            if attempt:
                await asyncio.sleep(block_ms / 1000)
            async with self.calling("take a job"):
                await self._make_groups()
                for klass in CLASSES:
                    claimed = await self._claim_stale(klass, consumer)
                    if claimed is not None:
                        return claimed
                for klass in CLASSES:
                    job = await self._read(consumer, klass)
                    if job is not None:
                        return job
        return None

    async def renew(self, job: Job, consumer: str) -> None:
        """Keep `job` claimed by `consumer` (resets its idle time); call well within claim_after."""
        async with self.calling("renew a claim"):
            await self.client.xclaim(
                self.stream(job.priority), GROUP, consumer, 0, [job.entry_id], justid=True
            )

    async def finish(
        self,
        job: Job,
        result: str,
        owner: tuple[str, str, str, str] | None = None,
        keep_s: int | None = None,
    ) -> bool:
        """Write `job`'s result (once: False when another finisher wrote it first; kept `keep_s`, by
        default `result_ttl_s`) and retire the job. `owner`: (record key, events key, record, end status)
        written with the first result, atomically (a background response's final object and the end of
        its events)."""
        keys = [
            self.result_key(job.job_id), self.stream(job.priority), self.tenant_key(job.tenant, job.uncapped),
            self.cancel_key(job.job_id),
        ]  # fmt: skip
        args: list[Any] = [result, keep_s or self.result_ttl_s, GROUP, job.entry_id, job.num_tokens]
        if owner is not None:
            keys += [owner[0], owner[1]]
            args += [owner[2], owner[3]]
        async with self.calling("finish a job"):
            first = await self._finish(keys=keys, args=args)
        return bool(first)

    async def release(self, job: Job) -> None:
        """Give `job` back unfinished (a drainer shutting down): it is delivered again at once."""
        async with self.calling("release a job"):
            # Idle time past claim_after: the next take claims it without waiting.
            await self.client.xclaim(
                self.stream(job.priority), GROUP, f"released-{job.job_id}", 0, [job.entry_id],
                idle=self.claim_after_ms + 1, justid=True,
            )  # fmt: skip

    # -- reading -----------------------------------------------------------------------------------------

    async def stats(self) -> list[ClassStats]:
        """Queued and running jobs, and the oldest one's age, per class."""
        out = []
        async with self.calling("read the queue's state"):
            await self._make_groups()
            now_ms = time.time() * 1000
            for klass in CLASSES:
                stream = self.stream(klass)
                length = int(await self.client.xlen(stream))
                pending = await self.client.xpending(stream, GROUP)
                running = int(pending["pending"])
                first = await self.client.xrange(stream, count=1)
                oldest = (now_ms - int(first[0][0].split("-")[0])) / 1000 if first else 0.0
                out.append(ClassStats(klass, max(length - running, 0), running, max(oldest, 0.0)))
        return out

    async def held_by(self, tenant: str) -> tuple[int, int]:
        """(jobs, tokens) `tenant` has queued or running."""
        async with self.calling("read a tenant's share"):
            values = await self.client.hmget(self.tenant_key(tenant), ["jobs", "tokens"])
        return int(values[0] or 0), int(values[1] or 0)

    async def check_server(self) -> list[str]:
        """What makes this Redis unfit for the queue role (eviction on, no AOF); [] when fit."""
        async with self.calling("read the server's settings"):
            policy = (await self.client.config_get("maxmemory-policy")).get("maxmemory-policy")
            appendonly = (await self.client.config_get("appendonly")).get("appendonly")
        problems = []
        if policy != "noeviction":
            problems.append(f"maxmemory-policy is {policy}, not noeviction: queued jobs may be evicted")
        if appendonly != "yes":
            problems.append("appendonly is off: queued jobs are lost if the Redis restarts")
        return problems

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- inside ------------------------------------------------------------------------------------------

    async def _make_groups(self) -> None:
        if self._groups_made:
            return
        for klass in CLASSES:
            try:
                await self.client.xgroup_create(self.stream(klass), GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_made = True

    async def _claim_stale(self, klass: int, consumer: str) -> Job | None:
        stream, start = self.stream(klass), "0-0"
        while True:  # XAUTOCLAIM looks at ten pending entries per call: follow its cursor to the end
            start, entries, _ = await self.client.xautoclaim(
                stream, GROUP, consumer, self.claim_after_ms, start, count=1
            )
            for entry_id, fields in entries:
                if not fields:  # deleted while pending
                    await self.client.xack(stream, GROUP, entry_id)
                    continue
                detail = await self.client.xpending_range(stream, GROUP, entry_id, entry_id, 1)
                deliveries = int(detail[0]["times_delivered"]) if detail else 1
                job_id = json.loads(fields["job"])["job_id"]
                logger.warning("took over job %s (delivery %d)", job_id, deliveries)
                return Job.from_fields(entry_id, fields, deliveries, self.max_attempts)
            if str(start) in ("0-0", "0"):
                return None

    async def _read(self, consumer: str, klass: int) -> Job | None:
        answer = await self.client.xreadgroup(GROUP, consumer, {self.stream(klass): ">"}, count=1)
        for _, entries in answer or ():
            for entry_id, fields in entries:
                return Job.from_fields(entry_id, fields, 1, self.max_attempts)
        return None

    @contextlib.asynccontextmanager
    async def calling(self, what: str) -> AsyncIterator[None]:
        """Around calls to the queue's Redis: a failure is QueueUnavailableError, saying `what` failed."""
        try:
            yield
        except (RedisError, OSError) as exc:
            raise QueueUnavailableError(f"the queue's Redis failed to {what}: {type(exc).__name__}") from exc
