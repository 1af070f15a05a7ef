"""Background Responses (OpenAI `background: true`) kept on the queue's Redis (docs/async.md).

A background response lives in three places on the queue role's Redis (noeviction, append-only), so any
codec replica reads it and none holds it:

- its record, `<prefix>response:<id>`: the tenant and the response object as it stands (`queued`, then
  `in_progress`, then final; `cancelled` as soon as a client cancels it);
- its events, `<prefix>events:<id>`: every streaming event, in sequence order (`response.queued` is 0,
  the run's events follow), which `GET /v1/responses/{id}?stream=true&starting_after=N` replays from N+1
  and then follows live; an entry without an event marks the end;
- its job on the queue (services/codec/lane/queue.py), whose result, written once, holds the final object.

Records and events expire `queue.result_ttl_s` after the response ends. Another tenant's ID reads as
absent (a 404).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from services.codec.lane.metrics import LaneMetrics
from services.codec.lane.queue import Job, JobQueue
from services.codec.state import CodecIdentity
from services.common import priority
from services.common.config import QueueConfig

KIND = "response"  # the jobs' kind
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
END = "end"  # the events stream's closing entry: its field, with the final status


@dataclass(frozen=True)
class JobRun:
    """A drainer's in-process request running a queued response: its ID and creation time."""

    response_id: str
    created_at: int


# Set by the drainer around its in-process request (its task's context only): the Responses route runs
# that request instead of queueing it again, under the queued response's ID.
JOB_RUN: ContextVar[JobRun | None] = ContextVar("kvrelay_job_run", default=None)


def cancelled(body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a response object) ended as cancelled: now, unless it says when already."""
    return {**body, "status": "cancelled", "completed_at": body.get("completed_at") or int(time.time())}


@dataclass(frozen=True)
class BackgroundRecord:
    tenant: str
    body: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"tenant": self.tenant, "body": self.body}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BackgroundRecord:
        record = json.loads(text)
        return cls(record["tenant"], record["body"])

    @property
    def is_over(self) -> bool:
        return self.body.get("status") in TERMINAL_STATUSES


class BackgroundResponses:
    """Background responses over `queue` (its Redis and key prefix)."""

    def __init__(self, queue: JobQueue, metrics: LaneMetrics) -> None:
        self.queue = queue
        self.metrics = metrics
        self.client = queue.client
        self.prefix = queue.prefix

    def record_key(self, response_id: str) -> str:
        return f"{self.prefix}response:{response_id}"

    def events_key(self, response_id: str) -> str:
        return f"{self.prefix}events:{response_id}"

    async def create(
        self,
        job: Job,
        body: dict[str, Any],
        queued_event: dict[str, Any],
        *,
        caps: tuple[int | None, int | None],
    ) -> None:
        """Keep the queued response and its `response.queued` event, then queue its job (QueueFullError
        past the tenant's `caps`, jobs and tokens: then nothing is kept)."""
        response_id = body["id"]
        async with self.queue.calling("keep a background response"):
            await self.client.set(self.record_key(response_id), BackgroundRecord(job.tenant, body).to_json())
            await self.client.xadd(self.events_key(response_id), {"event": json.dumps(queued_event)})
        try:
            await self.queue.enqueue(job, max_jobs=caps[0], max_tokens=caps[1])
        except BaseException:
            async with self.queue.calling("drop a refused background response"):
                await self.client.delete(self.record_key(response_id), self.events_key(response_id))
            raise
        self.metrics.created.labels(priority.name_of(job.priority)).inc()

    async def get(self, tenant: str, response_id: str) -> BackgroundRecord | None:
        """The response as it stands: its job's result once written, else its record. None when it is
        unknown, deleted or another tenant's."""
        async with self.queue.calling("read a background response"):
            kept, result = await self.client.mget(
                self.record_key(response_id), self.queue.result_key(response_id)
            )
        if kept is None:
            return None
        record = BackgroundRecord.from_json(result if result is not None else kept)
        return record if record.tenant == tenant else None

    async def put(self, record: BackgroundRecord) -> None:
        """Update the record as it stands, unless it was deleted meanwhile (XX), keeping its TTL."""
        async with self.queue.calling("update a background response"):
            await self.client.set(self.record_key(record.body["id"]), record.to_json(), xx=True, keepttl=True)

    async def forget(self, response_id: str) -> None:
        """Drop the record, the events and the result (a DELETE); a running job still ends, unseen."""
        async with self.queue.calling("delete a background response"):
            await self.client.delete(
                self.record_key(response_id), self.events_key(response_id), self.queue.result_key(response_id)
            )

    async def last_sequence(self, response_id: str) -> int:
        """The sequence number of the last event kept (-1: none)."""
        async with self.queue.calling("read a background response's events"):
            last = await self.client.xrevrange(self.events_key(response_id), count=2)
        kept = [fields["event"] for _, fields in last if "event" in fields]
        return int(json.loads(kept[0])["sequence_number"]) if kept else -1

    async def append(self, response_id: str, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        async with self.queue.calling("keep a background response's events"):
            pipe = self.client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(self.events_key(response_id), {"event": json.dumps(event, separators=(",", ":"))})
            await pipe.execute()

    async def finish(self, job: Job, final: dict[str, Any]) -> bool:
        """End the response with `final`: its job's result, its record and its events' end mark, written
        once and together (services/codec/lane/queue.py's finish); False when another finisher won."""
        record = BackgroundRecord(job.tenant, final)
        owner = (
            self.record_key(job.job_id),
            self.events_key(job.job_id),
            record.to_json(),
            str(final.get("status")),
        )
        return await self.queue.finish(job, record.to_json(), owner)

    async def events_after(
        self, response_id: str, after: int, *, poll_ms: int = 1000
    ) -> AsyncIterator[dict[str, Any]]:
        """Every event with a sequence number above `after`, kept ones first, then live ones as they
        come, until the end mark."""
        key, last_id = self.events_key(response_id), "0-0"
        while True:
            async with self.queue.calling("follow a background response's events"):
                answer = await self.client.xread({key: last_id}, count=100, block=poll_ms)
            for _, entries in answer or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    if END in fields:
                        return
                    event = json.loads(fields["event"])
                    if int(event["sequence_number"]) > after:
                        yield event


def background_from_config(
    config: QueueConfig, identity: CodecIdentity, registry: CollectorRegistry
) -> BackgroundResponses | None:
    """Background responses on `queue.url`'s Redis, for the model `identity` serves, their instruments
    on `registry`; None without a queue."""
    if config.url is None:
        return None
    queue = JobQueue.from_url(
        config.url,
        identity.model_fingerprint or identity.tokenizer_fingerprint,
        config.socket_timeout_ms / 1000,
        key_prefix=config.key_prefix,
        claim_after_s=config.claim_after_ms / 1000,
        max_attempts=config.max_attempts,
        result_ttl_s=config.result_ttl_s,
    )
    return BackgroundResponses(queue, LaneMetrics(registry))
