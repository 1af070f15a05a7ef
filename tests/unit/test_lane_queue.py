"""The durable queue (services/codec/lane/queue.py) on a real redis-server of the queue role (noeviction,
append-only file, fsync always) started on a free port: class order, caps, results written once, a dead
consumer's job taken over, cancellation, a Redis restart that loses nothing, and a Redis that is down."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.codec.lane.queue import Job, JobQueue, QueueFullError, QueueUnavailableError, new_job_id
from services.common import priority
from services.common.cache_redis import start_cache_redis, start_queue_redis, stop_cache_redis
from tests.ports import free_port

FINGERPRINT = "fp-queue-test"


@pytest.fixture
def redis_port(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = start_queue_redis(port, str(tmp_path))
    yield port
    stop_cache_redis(proc)


def make_queue(port: int, claim_after_s: float = 30.0, max_attempts: int = 3) -> JobQueue:
    return JobQueue.from_url(
        f"redis://127.0.0.1:{port}/0", FINGERPRINT, claim_after_s=claim_after_s, max_attempts=max_attempts
    )


@pytest.fixture
async def queue(redis_port: int) -> AsyncIterator[JobQueue]:
    q = make_queue(redis_port)
    yield q
    await q.aclose()


def job(tenant: str = "acme", klass: int = priority.NORMAL, tokens: int = 10, **payload: object) -> Job:
    return Job(new_job_id(), tenant, "test", dict(payload), klass, tokens)


async def test_the_server_is_of_the_queue_role(queue: JobQueue) -> None:
    assert await queue.check_server() == []


async def test_a_redis_of_the_cache_role_is_named_unfit(tmp_path: Path) -> None:
    port = free_port()
    proc = start_cache_redis(port, maxmemory_mb=64)  # allkeys-lru, no persistence: fine for KV, not jobs
    queue = make_queue(port)
    try:
        problems = await queue.check_server()
        assert len(problems) == 2 and "noeviction" in problems[0] and "appendonly" in problems[1]
    finally:
        await queue.aclose()
        stop_cache_redis(proc)


async def test_higher_classes_are_taken_first_then_by_arrival(queue: JobQueue) -> None:
    low, normal1, high, normal2 = (
        job(klass=priority.LOW),
        job(klass=priority.NORMAL),
        job(klass=priority.HIGH),
        job(klass=priority.NORMAL),
    )
    for j in (low, normal1, high, normal2):
        await queue.enqueue(j, max_jobs=None, max_tokens=None)
    taken = [await queue.take("c1") for _ in range(4)]
    assert [t.job_id for t in taken if t is not None] == [
        high.job_id,
        normal1.job_id,
        normal2.job_id,
        low.job_id,
    ]
    assert await queue.take("c1") is None
    stats = {s.priority: s for s in await queue.stats()}
    assert [(stats[k].queued, stats[k].running) for k in (priority.HIGH, priority.NORMAL, priority.LOW)] == [
        (0, 1), (0, 2), (0, 1)
    ]  # fmt: skip
    for t in taken:
        assert t is not None and await queue.finish(t, "done")
    assert all((s.queued, s.running) == (0, 0) for s in await queue.stats())


async def test_a_result_is_written_once(queue: JobQueue) -> None:
    await queue.enqueue(job(), max_jobs=None, max_tokens=None)
    taken = await queue.take("c1")
    assert taken is not None
    assert await queue.finish(taken, "first") is True
    assert await queue.finish(taken, "second") is False  # a finisher presumed dead, and was not
    assert await queue.result(taken.job_id) == "first"
    assert await queue.held_by("acme") == (0, 0)  # counted off once


async def test_a_late_finisher_after_the_result_is_gone_counts_nothing_twice(queue: JobQueue) -> None:
    await queue.enqueue(job(tokens=10), max_jobs=None, max_tokens=None)
    taken = await queue.take("c1")
    assert taken is not None and await queue.finish(taken, "first")
    await queue.client.delete(queue.result_key(taken.job_id))  # deleted, or expired
    await queue.finish(taken, "late")  # the first finisher presumed dead, finishing after all
    assert await queue.held_by("acme") == (0, 0)  # never below zero: the cap still holds


async def test_one_take_holds_one_job_whatever_the_classes_queued(queue: JobQueue) -> None:
    await queue.enqueue(job(klass=priority.HIGH), max_jobs=None, max_tokens=None)
    await queue.enqueue(job(klass=priority.LOW), max_jobs=None, max_tokens=None)
    assert await queue.take("c1", block_ms=10) is not None
    assert sum(s.running for s in await queue.stats()) == 1  # the low one is still there for anyone


async def test_a_stale_job_behind_ten_live_ones_is_taken_over(redis_port: int) -> None:
    queue = make_queue(redis_port, claim_after_s=0.5)
    try:
        live = []
        for i in range(10):
            await queue.enqueue(job(n=i), max_jobs=None, max_tokens=None)
            taken = await queue.take("alive")
            assert taken is not None
            live.append(taken)
        await queue.enqueue(job(n=10), max_jobs=None, max_tokens=None)
        stale = await queue.take("dead")
        assert stale is not None
        deadline, found = time.monotonic() + 30, None
        while found is None:
            assert time.monotonic() < deadline, "the stale job behind ten pending ones was never found"
            for t in live:
                await queue.renew(t, "alive")
            found = await queue.take("other")
        assert found.job_id == stale.job_id
    finally:
        await queue.aclose()


async def test_a_tenant_over_its_caps_is_refused_until_a_job_finishes(queue: JobQueue) -> None:
    for _ in range(2):
        await queue.enqueue(job(tokens=10), max_jobs=2, max_tokens=None)
    with pytest.raises(QueueFullError) as full:
        await queue.enqueue(job(tokens=10), max_jobs=2, max_tokens=None)
    assert full.value.wire_error().status == 429 and full.value.what == "jobs"
    with pytest.raises(QueueFullError) as tokens:
        await queue.enqueue(job(tokens=81), max_jobs=None, max_tokens=100)
    assert tokens.value.what == "tokens"
    await queue.enqueue(job(tenant="other"), max_jobs=2, max_tokens=None)  # caps are per tenant
    taken = await queue.take("c1")
    assert taken is not None and await queue.finish(taken, "ok")
    await queue.enqueue(job(tokens=10), max_jobs=2, max_tokens=None)
    assert await queue.held_by("acme") == (2, 20)


async def test_a_dead_consumers_job_is_taken_over_and_a_renewed_one_is_not(redis_port: int) -> None:
    queue = make_queue(redis_port, claim_after_s=0.5, max_attempts=2)
    try:
        kept, lost = job(n=1), job(n=2)
        await queue.enqueue(kept, max_jobs=None, max_tokens=None)
        await queue.enqueue(lost, max_jobs=None, max_tokens=None)
        first, second = await queue.take("alive"), await queue.take("dead")
        assert first is not None and second is not None and first.deliveries == second.deliveries == 1
        taken_over = None
        deadline = time.monotonic() + 30
        while taken_over is None:  # "dead" never renews; "alive" renews before every look
            assert time.monotonic() < deadline, "the dead consumer's job was never taken over"
            await queue.renew(first, "alive")
            taken_over = await queue.take("other")
        assert taken_over.job_id == second.job_id and taken_over.payload == {"n": 2}
        assert taken_over.deliveries == 2 and not taken_over.exhausted
        exhausted = None
        while exhausted is None:  # once more past max_attempts: handed out to be failed
            assert time.monotonic() < deadline
            await queue.renew(first, "alive")
            exhausted = await queue.take("third")
        assert exhausted.job_id == second.job_id and exhausted.exhausted
        assert await queue.finish(first, "ok") and await queue.finish(exhausted, "failed")
        assert await queue.take("other") is None
    finally:
        await queue.aclose()


async def test_a_released_job_is_delivered_again_at_once(queue: JobQueue) -> None:
    await queue.enqueue(job(), max_jobs=None, max_tokens=None)
    taken = await queue.take("stopping")
    assert taken is not None
    await queue.release(taken)
    again = await queue.take("next")
    assert again is not None and again.job_id == taken.job_id and again.deliveries == 2


async def test_a_job_that_costs_no_tokens_finishes_too(queue: JobQueue) -> None:
    await queue.enqueue(job(tokens=0), max_jobs=None, max_tokens=None)
    taken = await queue.take("c1")
    assert taken is not None and await queue.finish(taken, "ok")  # Lua's -0 is no integer to HINCRBY
    assert await queue.held_by("acme") == (0, 0)


async def test_cancel_flags_a_job_until_it_finishes(queue: JobQueue) -> None:
    await queue.enqueue(queued := job(), max_jobs=None, max_tokens=None)
    await queue.cancel(queued.job_id)
    taken = await queue.take("c1")
    assert taken is not None and await queue.is_cancelled(taken.job_id)
    assert await queue.finish(taken, "cancelled")
    assert not await queue.is_cancelled(taken.job_id)


async def test_a_redis_restart_loses_no_acknowledged_job(tmp_path: Path) -> None:
    port = free_port()
    proc = start_queue_redis(port, str(tmp_path))
    queue = make_queue(port)
    try:
        ids = []
        for i in range(20):
            j = job(n=i)
            await queue.enqueue(j, max_jobs=None, max_tokens=None)
            ids.append(j.job_id)
        running = await queue.take("c1")  # taken, not finished, when the Redis dies
        proc.send_signal(signal.SIGKILL)  # no shutdown save: only the append-only file remains
        proc.wait()
        with pytest.raises(QueueUnavailableError):
            await queue.take("c1")
        proc = start_queue_redis(port, str(tmp_path))
        seen = []
        again = await queue.take("c2")  # the queued ones; the running one stays c1's, pending
        while again is not None:
            seen.append(again.job_id)
            await queue.finish(again, "ok")
            again = await queue.take("c2")
        assert running is not None and sorted(seen) == sorted(i for i in ids if i != running.job_id)
        assert await queue.held_by("acme") == (1, 10)  # the running one is still owed
    finally:
        await queue.aclose()
        stop_cache_redis(proc)


async def test_a_redis_that_is_down_is_queue_unavailable() -> None:
    queue = make_queue(free_port())
    try:
        with pytest.raises(QueueUnavailableError) as down:
            await queue.enqueue(job(), max_jobs=None, max_tokens=None)
        assert down.value.wire_error().status == 503
    finally:
        await queue.aclose()


def test_job_fields_round_trip() -> None:
    original = job(klass=priority.LOW, tokens=42, body={"input": "hi"})
    back = Job.from_fields("1-0", original.fields(), 1, 3)
    assert (back.job_id, back.tenant, back.priority, back.num_tokens, back.payload) == (
        original.job_id, "acme", priority.LOW, 42, {"body": {"input": "hi"}}
    )  # fmt: skip
