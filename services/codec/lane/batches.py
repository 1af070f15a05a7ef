"""Batches on the async lane (docs/batches.md): OpenAI's Files and Batches APIs and Anthropic's Message
Batches, kept in the batch store (PostgreSQL, lane/batch_store.py) and run as queue jobs.

Each line of a batch is one job of the low class on the queue (lane/queue.py), of kind `batch_line`,
so a batch's lines spread over every drainer and fill idle capacity only. A drainer runs a line through
the codec app in-process as the batch's tenant (quotas charged, exactly as an interactive request), and
writes the answer as the line's result, once. The line whose result completes the batch ends it: the
output and error files written and the status made final in one transaction.

- cancel: the batch is `cancelling`; its lines not started end `cancelled` at once, the running ones
  finish (their results are kept); the batch is `cancelled` when the last one ends.
- expiry: a batch still in progress at its `expires_at` (`batches.completion_window_s` after creation) is
  closed the same way, its unstarted lines ending `expired` (`batch_expired` in the error file). Every
  drainer sweeps for such batches every `batches.sweep_ms`.
- A drainer that dies mid-line: the queue hands the job to another, which runs the line again (it is
  not done); a line is done once, so every custom_id is answered exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp

from services.codec.admission.auth import Authenticator
from services.codec.lane import inprocess
from services.codec.lane.batch_store import (
    OPEN,
    BatchRow,
    BatchStore,
    BatchStoreUnavailableError,
    FileRow,
    LineRow,
    NewFile,
)
from services.codec.lane.metrics import BatchMetrics
from services.codec.lane.queue import Job, JobQueue, QueueUnavailableError
from services.common import priority
from services.common.config import BatchesConfig
from services.common.tenants import Tenant

logger = logging.getLogger("kvrelay.batches")

LINE_KIND = "batch_line"  # the queue jobs' kind
LINE_RESULT_KEEP_S = 3600  # a line job's queue result is only a marker: the line's result is in the store
_CLOSED = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
_CLOSED_MESSAGE = {
    "cancelled": "the batch was cancelled before this request ran",
    "expired": "this request could not be run before the batch's completion window ended",
}


class Batches:
    def __init__(self, store: BatchStore, queue: JobQueue, config: BatchesConfig, metrics: BatchMetrics):
        self.store = store
        self.queue = queue
        self.config = config
        self.metrics = metrics

    # -- files -------------------------------------------------------------------------------------------

    async def add_file(
        self, tenant: str, purpose: str, filename: str, content: bytes, ttl_s: int | None
    ) -> FileRow:
        ttl = ttl_s if ttl_s is not None else self.config.file_ttl_s
        new = NewFile("file-" + uuid.uuid4().hex, purpose, filename, content, int(time.time()) + ttl)
        return await self.store.add_file(tenant, new, max_files=self.config.max_files)

    # -- batches -----------------------------------------------------------------------------------------

    async def create(
        self, tenant: Tenant, api: str, lines: list[LineRow], detail: dict[str, Any]
    ) -> BatchRow:
        """Keep a batch of checked `lines` and queue a job for each runnable one."""
        prefix = "batch_" if api == "openai" else "msgbatch_"
        now = int(time.time())
        batch = BatchRow(
            prefix + uuid.uuid4().hex, tenant.tenant_id, api, tenant.key_id, "in_progress", now,
            now + self.config.completion_window_s, len(lines), detail,
        )  # fmt: skip
        await self.store.add_batch(batch, lines)
        jobs = [_line_job(batch, line.idx) for line in lines if line.request is not None]
        try:
            await self.queue.enqueue_many(jobs)
        except BaseException:
            with contextlib.suppress(BatchStoreUnavailableError):
                await self.store.drop_batch(batch.batch_id)
            raise
        self.metrics.created.labels(api).inc()
        if not jobs:  # every line refused: it ends now
            await self.finalize(batch.batch_id)
        return await self.store.batch(None, batch.batch_id) or batch

    async def cancel(self, tenant: str, batch_id: str) -> BatchRow | None:
        """Cancel the batch (its unstarted lines at once); it as it stands after; None when unknown."""
        if await self.store.close(batch_id, tenant, "cancelling", "cancelling_at"):
            await self.finalize(batch_id)
        return await self.store.batch(tenant, batch_id)

    async def finalize(self, batch_id: str) -> None:
        ended = await self.store.finalize(batch_id, self._render)
        if ended is not None:
            self.metrics.ended.labels(ended.api, ended.status).inc()

    def _render(self, batch: BatchRow, lines: list[LineRow]) -> tuple[list[NewFile], dict[str, Any]]:
        """A finishing batch's files (OpenAI: output and error files) and detail stamps."""
        now = int(time.time())
        final = {"in_progress": "completed_at", "cancelling": "cancelled_at", "expiring": "expired_at"}
        detail: dict[str, Any] = {"finalizing_at": now, final[batch.status]: now}
        if batch.api != "openai":
            return [], detail
        output: list[str] = []
        errors: list[str] = []
        for line in lines:
            record = openai_result(batch.batch_id, line)
            (output if line.outcome == "succeeded" else errors).append(json.dumps(record) + "\n")
        files = []
        expires_at = now + int(batch.detail.get("output_ttl_s") or self.config.file_ttl_s)
        for name, records in (("output", output), ("error", errors)):
            if records:
                new = NewFile(
                    "file-" + uuid.uuid4().hex, "batch_output", f"{batch.batch_id}_{name}.jsonl",
                    "".join(records).encode(), expires_at,
                )  # fmt: skip
                files.append(new)
                detail[f"{name}_file_id"] = new.file_id
        return files, detail

    # -- upkeep (on drainers) ----------------------------------------------------------------------------

    async def sweep(self) -> None:
        """Close the batches past their expiry, end the closing ones whose lines are all done, and drop
        expired files and batches ended longer ago than the files' retention."""
        now = int(time.time())
        expired, closing = await self.store.due(now)
        for batch_id in expired:
            if await self.store.close(batch_id, None, "expiring", "expired_at"):
                logger.info("batch %s expired", batch_id)
        for batch_id in expired + closing:
            await self.finalize(batch_id)
        await self.store.forget_before(now, now - self.config.file_ttl_s)

    async def sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except BatchStoreUnavailableError:
                pass
            except Exception as exc:  # a bug here must not end the sweeping
                logger.error("the batch sweep failed", exc_info=exc)
            await asyncio.sleep(self.config.sweep_ms / 1000)

    async def refresh_forever(self, every_s: float) -> None:
        """Read the store's census into the gauges every `every_s` until cancelled."""
        while True:
            try:
                self.metrics.show(*await self.store.census())
                self.metrics.up.set(1)
            except BatchStoreUnavailableError:
                self.metrics.up.set(0)
            except Exception as exc:  # a bug here must not end the refreshing
                logger.error("reading the batch store's census failed", exc_info=exc)
            await asyncio.sleep(every_s)

    # -- one line (on drainers) --------------------------------------------------------------------------

    async def run_line(self, job: Job, app: ASGIApp, authenticator: Authenticator) -> str:
        """Run the line `job` names, keep its result and retire the job: the line's outcome (`skipped`
        when it was done already or its batch is closing)."""
        batch_id, idx = str(job.payload["batch"]), int(job.payload["line"])
        status, line, attempts = await self.store.claim(batch_id, idx)
        if line is None or line.request is None:
            await self.store.end_line(batch_id, idx, status)
            if status in OPEN:
                await self.finalize(batch_id)
            await self.queue.finish(job, "skipped", keep_s=LINE_RESULT_KEEP_S)
            return "skipped"
        try:
            outcome, result = await self._answer(job, line, attempts, app, authenticator)
        except (BatchStoreUnavailableError, QueueUnavailableError, asyncio.CancelledError):
            raise  # left pending: run again later
        except Exception as exc:  # a bug here must not leave the line unanswered
            logger.error("line %d of batch %s failed in the drainer", idx, batch_id, exc_info=exc)
            outcome = "errored"
            result = {
                "error": {"code": "server_error", "message": f"the drainer failed: {type(exc).__name__}"}
            }
        if outcome in _CLOSED:
            await self.store.end_line(batch_id, idx, "cancelling" if outcome == "cancelled" else "expiring")
        else:
            await self.store.finish_line(batch_id, idx, outcome, result)
        self.metrics.lines.labels(outcome).inc()
        # Ended before the job is retired: a drainer that dies between the two leaves the job, whose next
        # run finds the line done and ends the batch (and the sweeper ends any batch left with no line).
        await self.finalize(batch_id)
        await self.queue.finish(job, outcome, keep_s=LINE_RESULT_KEEP_S)
        return outcome

    async def _answer(
        self, job: Job, line: LineRow, attempts: int, app: ASGIApp, authenticator: Authenticator
    ) -> tuple[str, dict[str, Any]]:
        assert line.request is not None
        tenant = authenticator.tenant_of_key(job.key_id)
        if tenant is None or tenant.tenant_id != job.tenant:
            return "errored", {
                "error": {"code": "invalid_api_key", "message": "the batch's API key was revoked"}
            }
        if attempts > self.queue.max_attempts:  # its drainers kept dying (not: the store was away)
            message = f"the line was started {attempts - 1} times and never finished"
            return "errored", {"error": {"code": "server_error", "message": message}}
        give_up = time.monotonic() + inprocess.REFUSED_FOR_S
        while True:
            answer = await inprocess.post(
                app, line.request["url"], line.request["body"], job.priority, tenant
            )
            if answer.status not in inprocess.RETRYABLE or time.monotonic() > give_up:
                break
            self.metrics.lines.labels("retried").inc()
            await asyncio.sleep(1.0)  # refused for a quota or overload: the slot or budget comes back
            batch = await self.store.batch(None, str(job.payload["batch"]))
            if batch is None or batch.status != "in_progress":
                return ("expired" if batch is not None and batch.status == "expiring" else "cancelled"), {}
        result = {"status_code": answer.status, "request_id": answer.request_id, "body": answer.json()}
        return ("succeeded" if answer.status == 200 else "errored"), result


def _line_job(batch: BatchRow, idx: int) -> Job:
    """The queue job of a batch's line: low class, no token cost (a batch is capped by its own limits)."""
    payload = {"batch": batch.batch_id, "line": idx}
    return Job(
        f"{batch.batch_id}.{idx}", batch.tenant, LINE_KIND, payload, priority.LOW, 0, batch.key_id,
        float(batch.created_at), uncapped=True,
    )  # fmt: skip


def openai_result(batch_id: str, line: LineRow) -> dict[str, Any]:
    """A line's record in an OpenAI batch's output or error file."""
    record: dict[str, Any] = {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.idx}",
        "custom_id": line.custom_id,
        "response": None,
        "error": None,
    }
    result = line.result or {}
    if "status_code" in result:
        record["response"] = result
    elif line.outcome in _CLOSED:
        record["error"] = {"code": _CLOSED[line.outcome], "message": _CLOSED_MESSAGE[line.outcome]}
    else:
        error = result.get("error", {})
        record["error"] = {
            "code": error.get("code"),
            "message": error.get("message"),
            "line": error.get("line"),
        }
    return record


def anthropic_result(line: LineRow) -> dict[str, Any]:
    """A line's record in an Anthropic batch's results."""
    result = line.result or {}
    if line.outcome == "succeeded":
        outcome: dict[str, Any] = {"type": "succeeded", "message": result["body"]}
    elif line.outcome == "errored":
        body = result.get("body")
        if not (isinstance(body, dict) and body.get("type") == "error"):
            error = result.get("error", {})
            body = {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": str(error.get("message", "refused"))},
            }
        outcome = {"type": "errored", "error": body}
    else:
        outcome = {"type": "canceled" if line.outcome == "cancelled" else "expired"}
    return {"custom_id": line.custom_id, "result": outcome}


def batches_from_config(
    config: BatchesConfig, queue: JobQueue | None, metrics: BatchMetrics
) -> Batches | None:
    """Batches over `batches.store_url` and the queue; None unless both are configured."""
    if config.store_url is None or queue is None:
        return None
    store = BatchStore(config.store_url, prefix=config.table_prefix, timeout_s=config.timeout_ms / 1000)
    return Batches(store, queue, config, metrics)
