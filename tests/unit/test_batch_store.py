"""The batch store and a batch's lifecycle below the HTTP routes (lane/batch_store.py, lane/batches.py), on
a real PostgreSQL database and a real queue-role redis-server: the tables made once under concurrent first
use; a batch whose last finisher died before ending it ended by the sweep; a line's starts counted in the
store (a store that was away costs none); text PostgreSQL refuses (NUL, lone surrogates) kept as U+FFFD
and '?'; another tenant's cursor reads nothing; batch lines counted apart from the tenant's capped jobs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from services.codec.lane.batch_store import BatchStore, LineRow
from services.codec.lane.batches import Batches
from services.codec.lane.metrics import BatchMetrics
from services.codec.lane.queue import JobQueue
from services.common.cache_redis import start_queue_redis, stop_cache_redis
from services.common.config import BatchesConfig
from services.common.tenants import Tenant
from tests.ports import free_port
from tests.postgres import fresh_database

TENANT = Tenant("acme", "key-1", b"0" * 16)
BODY = {"url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = start_queue_redis(port, str(tmp_path_factory.mktemp("queue")))
    yield f"redis://127.0.0.1:{port}/0"
    stop_cache_redis(proc)


@pytest.fixture
def database() -> Iterator[str]:
    with fresh_database() as url:
        yield url


@pytest_asyncio.fixture
async def batches(database: str, redis_url: str) -> AsyncIterator[Batches]:
    store = BatchStore(database)
    await store.open()
    queue = JobQueue.from_url(redis_url, "fp-store-test")
    try:
        yield Batches(store, queue, BatchesConfig(store_url=database), BatchMetrics(CollectorRegistry()))
    finally:
        await store.aclose()
        await queue.aclose()


async def test_concurrent_first_use_makes_the_tables_once(database: str) -> None:
    stores = [BatchStore(database) for _ in range(4)]
    try:
        for store in stores:
            await store.open()
        counts = await asyncio.gather(*(store.census() for store in stores))
        assert all(by_status == {} for by_status, _ in counts)
    finally:
        for store in stores:
            await store.aclose()


async def test_a_batch_whose_last_finisher_died_is_ended_by_the_sweep(batches: Batches) -> None:
    row = await batches.create(TENANT, "openai", [LineRow(0, "a", BODY), LineRow(1, "b", BODY)], _detail())
    for idx in (0, 1):  # run and written, but the drainer died before it ended the batch
        status, line, attempts = await batches.store.claim(row.batch_id, idx)
        assert status == "in_progress" and line is not None and attempts == 1
        await batches.store.finish_line(row.batch_id, idx, "succeeded", {"status_code": 200, "body": {}})
    assert (await batches.store.batch(None, row.batch_id)).status == "in_progress"  # type: ignore[union-attr]
    await batches.sweep()
    ended = await batches.store.batch(None, row.batch_id)
    assert ended is not None and ended.status == "completed" and ended.detail["output_file_id"]


async def test_a_lines_starts_are_counted_in_the_store(batches: Batches) -> None:
    row = await batches.create(TENANT, "openai", [LineRow(0, "a", BODY)], _detail())
    for expected in (1, 2, 3):  # its drainers died: each start counted
        assert (await batches.store.claim(row.batch_id, 0))[2] == expected
    await batches.store.finish_line(row.batch_id, 0, "errored", {"error": {"message": "x"}})
    status, line, attempts = await batches.store.claim(row.batch_id, 0)
    assert (status, line, attempts) == ("in_progress", None, 0)  # done: never started again


async def test_text_postgresql_refuses_is_kept_replaced(batches: Batches) -> None:
    row = await batches.create(TENANT, "openai", [LineRow(0, "a", BODY)], _detail())
    await batches.store.claim(row.batch_id, 0)
    body = {"choices": [{"message": {"content": "nul\x00 and \ud800 surrogate"}}]}
    assert await batches.store.finish_line(row.batch_id, 0, "succeeded", {"status_code": 200, "body": body})
    [line] = await batches.store.lines(row.batch_id)
    assert line.result is not None
    assert line.result["body"]["choices"][0]["message"]["content"] == "nul\ufffd and ? surrogate"


async def test_another_tenants_cursor_reads_nothing(batches: Batches) -> None:
    mine = await batches.create(TENANT, "openai", [LineRow(0, "a", BODY)], _detail())
    other = Tenant("other", "key-2", b"1" * 16)
    await batches.create(other, "openai", [LineRow(0, "a", BODY)], _detail())
    assert await batches.store.batches("other", "openai", after=mine.batch_id, before=None, limit=10) == []


async def test_batch_lines_are_counted_apart_from_the_capped_jobs(batches: Batches) -> None:
    lines = [LineRow(i, f"c{i}", BODY) for i in range(5)]
    await batches.create(TENANT, "openai", lines, _detail())
    assert await batches.queue.held_by(TENANT.tenant_id) == (0, 0)  # background work is not held back
    held = await batches.queue.client.hget(batches.queue.tenant_key(TENANT.tenant_id, uncapped=True), "jobs")
    assert int(held) >= 5


def _detail() -> dict[str, object]:
    return {"endpoint": "/v1/chat/completions", "input_file_id": "file-x", "model": "m"}
