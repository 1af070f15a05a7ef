"""The drainer: runs queued background responses at spare capacity (docs/async.md).

A drainer is a role of the codec (`kvrelay drainer`, the chart's `drainer` Deployment): the same process,
app and code path as a codec answering clients, so a queued request is rendered, admitted (the tenant's
quotas charged, its priority class kept) and streamed exactly as an interactive one. It calls its own
app in-process, as the job's tenant (admission/tenancy.py JOB_TENANT; the key that queued the job must
still stand), under the queued response's ID (protocols/openai_responses_background.py JOB_RUN).

It takes a job only while it runs fewer than `queue.drain_concurrency` and the pools' waiting requests
(the router's load reports) are at most `queue.drain_max_waiting`: queued work fills idle capacity and
never queues ahead of interactive requests. While a job runs it renews its claim, keeps each event on
the queue's Redis (events numbered after `response.queued`; on a retry only those past the last kept one),
and watches the job's cancel flag. A quota or overload refusal before the first event waits and tries
again; any other refusal or failure ends the response `failed`, with the error. A job delivered
`queue.max_attempts` times without finishing (its drainers died) fails.

On SIGTERM (the app's shutdown) it takes no more jobs, lets the running ones finish for the grace
period, then gives the rest back to the queue, where another drainer takes them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message

from services.codec.admission.auth import Authenticator
from services.codec.backend.protocol import ServiceStatus
from services.codec.lane import inprocess
from services.codec.lane.background import (
    JOB_RUN,
    KIND,
    BackgroundRecord,
    BackgroundResponses,
    JobRun,
    cancelled,
)
from services.codec.lane.batch_store import BatchStoreUnavailableError
from services.codec.lane.batches import LINE_KIND, Batches
from services.codec.lane.inprocess import REFUSED_FOR_S, RETRYABLE
from services.codec.lane.queue import Job, QueueUnavailableError
from services.common.config import QueueConfig
from services.common.tenants import Tenant

logger = logging.getLogger("kvrelay.drainer")

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
WORKER_ROLES = frozenset({"colocated", "prefill", "decode"})
CANCEL_CHECK_S = 0.2  # how often a running job looks at its cancel flag


class Drainer:
    def __init__(
        self,
        app: ASGIApp,
        background: BackgroundResponses,
        authenticator: Authenticator,
        config: QueueConfig,
        statuses: Callable[[], Awaitable[list[ServiceStatus]]],
        batches: Batches | None = None,
    ) -> None:
        self.app = app
        self.batches = batches
        self.background = background
        self.queue = background.queue
        self.authenticator = authenticator
        self.config = config
        self.statuses = statuses
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.drained = background.metrics.drained
        self.running: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()
        self._unavailable_logged = False

    # -- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Take and start jobs until `stop`."""
        poll_s = self.config.drain_poll_ms / 1000
        logger.info("drainer started", extra={"consumer": self.consumer})
        while not self._stopping.is_set():
            if len(self.running) >= self.config.drain_concurrency or not await self._has_spare_capacity():
                await self._pause(poll_s)
                continue
            try:
                job = await self.queue.take(self.consumer, block_ms=self.config.drain_poll_ms)
            except QueueUnavailableError as exc:
                if not self._unavailable_logged:
                    logger.error("the queue is unavailable: %s", exc)
                    self._unavailable_logged = True
                await self._pause(poll_s)
                continue
            self._unavailable_logged = False
            if job is not None and self._stopping.is_set():  # taken while stopping: another drainer's
                with contextlib.suppress(QueueUnavailableError):
                    await self.queue.release(job)
            elif job is not None:
                self.running[job.job_id] = asyncio.create_task(self._run(job), name=f"job-{job.job_id}")

    async def stop(self, grace_s: float) -> None:
        """Take no more jobs; let the running ones finish for `grace_s`, then give the rest back."""
        self._stopping.set()
        tasks = list(self.running.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _has_spare_capacity(self) -> bool:
        try:
            statuses = await self.statuses()
        except Exception:  # the router is away: nothing would run anyway
            return False
        workers = [s for s in statuses if s.role in WORKER_ROLES]
        return bool(workers) and sum(s.waiting for s in workers) <= self.config.drain_max_waiting

    # -- one job -----------------------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        renewing = asyncio.create_task(self._renew(job))
        try:
            if job.kind == LINE_KIND and self.batches is None:
                # Not this drainer's to run (it has no batch store): left unrenewed, the next drainer to
                # look takes it over after queue.claim_after_ms.
                logger.error(
                    "job %s is a batch line, but this drainer has no batch store (batches.store_url)",
                    job.job_id,
                )
                return
            if job.kind == LINE_KIND and self.batches is not None:
                await self.batches.run_line(job, self.app, self.authenticator)
            else:
                await self._run_response(job)
        except asyncio.CancelledError:
            with contextlib.suppress(QueueUnavailableError):
                await asyncio.shield(self.queue.release(job))  # shutting down: another drainer takes it
            self.drained.labels("released").inc()
            raise
        except (QueueUnavailableError, BatchStoreUnavailableError) as exc:  # taken over once it is back
            logger.error("job %s left to be retried: %s", job.job_id, exc)
        except Exception as exc:  # a bug: the job stays pending, taken over after queue.claim_after_ms
            logger.error("job %s failed in the drainer; left to be retried", job.job_id, exc_info=exc)
        finally:
            renewing.cancel()
            self.running.pop(job.job_id, None)

    async def _run_response(self, job: Job) -> None:
        try:
            final = await self._outcome(job)
        except (asyncio.CancelledError, QueueUnavailableError):
            raise
        except Exception as exc:  # a bug here must not leave the job pending forever: it fails
            logger.error("job %s failed in the drainer", job.job_id, exc_info=exc)
            record = await self.background.get(job.tenant, job.job_id)
            body = record.body if record is not None else {"id": job.job_id}
            final = _failed(body, f"the drainer failed: {type(exc).__name__}")
        await self.background.finish(job, final)
        self.drained.labels(str(final.get("status"))).inc()

    async def _renew(self, job: Job) -> None:
        every = max(self.queue.claim_after_ms / 3000, 0.05)
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(QueueUnavailableError):
                await self.queue.renew(job, self.consumer)

    async def _outcome(self, job: Job) -> dict[str, Any]:
        """The job's final response object."""
        record = await self.background.get(job.tenant, job.job_id)
        if record is None or job.kind != KIND:
            return _failed({"id": job.job_id}, "the queued response is gone (expired or deleted)")
        if await self.queue.is_cancelled(job.job_id):
            return cancelled(record.body)
        if job.exhausted:
            return _failed(record.body, f"the job was started {job.deliveries - 1} times and never finished")
        tenant = self.authenticator.tenant_of_key(job.key_id)
        if tenant is None or tenant.tenant_id != job.tenant:
            return _failed(record.body, "the API key that queued this response was revoked")
        await self.background.put(BackgroundRecord(job.tenant, {**record.body, "status": "in_progress"}))
        give_up = time.monotonic() + REFUSED_FOR_S
        while True:
            run = _Run(self, job, tenant, record)
            outcome = await run.run()
            if outcome is not None:
                return outcome
            if time.monotonic() > give_up:  # a budget that never comes back (a prompt over the TPM quota)
                return _failed(
                    record.body, f"refused for {REFUSED_FOR_S:.0f} s: {run.refusal}", "rate_limited"
                )
            self.drained.labels("retried").inc()
            await asyncio.sleep(1.0)  # refused for a quota or overload: the slot or budget comes back
            if await self.queue.is_cancelled(job.job_id):
                return cancelled(record.body)


def _failed(body: dict[str, Any], message: str, code: str = "server_error") -> dict[str, Any]:
    return {
        **body,
        "status": "failed",
        "error": {"code": code, "message": message},
        "completed_at": int(time.time()),
    }


class _Run:
    """One in-process call of the codec app for a queued response."""

    def __init__(self, drainer: Drainer, job: Job, tenant: Tenant, record: BackgroundRecord) -> None:
        self.drainer = drainer
        self.job = job
        self.tenant = tenant
        self.record = record
        self.latest = record.body  # the response object as the last event showed it
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.leave = asyncio.Event()  # set: the in-process client disconnects (a cancel)
        self.refusal = ""  # why the app refused it (a quota or overload: the caller tries again)
        self.call: asyncio.Future[None]

    async def run(self) -> dict[str, Any] | None:
        """The final response object; None when refused for a quota or overload before it started."""
        background, job = self.drainer.background, self.job
        last = await background.last_sequence(job.job_id)
        body = json.dumps({**job.payload, "stream": True}).encode()
        run_token = JOB_RUN.set(JobRun(job.job_id, int(job.enqueued_at)))
        try:  # the app's task copies this context: the mark reaches the route, nothing else
            self.call = inprocess.start(
                self.drainer.app,
                inprocess.post_scope("/v1/responses", job.priority),
                self._receive(body),
                self.messages.put,
                self.tenant,
            )
        finally:
            JOB_RUN.reset(run_token)
        try:
            return await self._follow(last)
        finally:
            self.leave.set()
            await asyncio.gather(self.call, return_exceptions=True)

    async def _next(self) -> Message | None:
        """The app's next message; None after CANCEL_CHECK_S without one. Raises if the app ended
        without answering."""
        getting: asyncio.Future[Any] = asyncio.ensure_future(self.messages.get())
        watched: set[asyncio.Future[Any]] = {getting, self.call}
        done, _ = await asyncio.wait(watched, timeout=CANCEL_CHECK_S, return_when=asyncio.FIRST_COMPLETED)
        if getting in done:
            return getting.result()
        getting.cancel()
        if self.call in done and self.messages.empty():
            raise RuntimeError(f"the app ended without an answer: {self.call.exception()!r}")
        return None

    async def _follow(self, last: int) -> dict[str, Any] | None:
        start = await self._next()
        while start is None:
            start = await self._next()
        status = int(start.get("status", 500))
        if status != 200:
            text = await self._rest()
            if status in RETRYABLE:
                self.refusal = _error_message(text)
                return None
            return _failed(
                self.latest, _error_message(text), "invalid_request" if status < 500 else "server_error"
            )
        buffer, checked = "", time.monotonic()
        while True:
            message = await self._next()
            if time.monotonic() - checked >= CANCEL_CHECK_S:
                checked = time.monotonic()
                if await self.drainer.queue.is_cancelled(self.job.job_id):
                    return cancelled(self.latest)
            if message is None:
                continue
            buffer += message.get("body", b"").decode()
            *lines, buffer = buffer.split("\n")
            final = await self._keep([line[6:] for line in lines if line.startswith("data: {")], last)
            if final is not None:
                return final
            if not message.get("more_body", False):
                return _failed(self.latest, "the response ended without a final event")

    async def _rest(self) -> str:
        parts = []
        while True:
            message = await self._next()
            if message is None:
                continue
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts).decode(errors="replace")

    async def _keep(self, payloads: list[str], last: int) -> dict[str, Any] | None:
        """Keep the events past `last` (renumbered after response.queued); the final object if one ends."""
        events, final = [], None
        for payload in payloads:
            event = json.loads(payload)
            if "sequence_number" not in event:  # an in-band error without one: response.failed follows
                continue
            event["sequence_number"] = int(event["sequence_number"]) + 1
            if isinstance(event.get("response"), dict):
                self.latest = event["response"]
            if event["type"] in TERMINAL_EVENTS:
                final = event["response"]
                # the final event is always kept: a re-run shorter than its first attempt still ends
                event["sequence_number"] = max(event["sequence_number"], last + 1)
            if event["sequence_number"] > last:
                events.append(event)
        await self.drainer.background.append(self.job.job_id, events)
        return final

    def _receive(self, body: bytes) -> Callable[[], Awaitable[Message]]:
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.leave.wait()
            return {"type": "http.disconnect"}

        return receive


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500] or "the request was refused"
