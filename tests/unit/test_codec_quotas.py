"""Quota stores (in memory and on the real Redis at 127.0.0.1:6379) and the `Quotas` policy on top."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.codec.admission.errors import QuotaUnavailableError, RateLimitedError
from services.codec.admission.metrics import LimitsMetrics
from services.codec.admission.quota_memory import MemoryQuotaStore
from services.codec.admission.quota_redis import RedisQuotaStore
from services.codec.admission.quota_store import (
    Charge,
    Denial,
    QuotaStore,
    Reservation,
    counter_name,
    wait_s,
)
from services.codec.admission.quotas import Quotas
from services.common.config import QuotasConfig, TenantQuota

REDIS_URL = "redis://127.0.0.1:6379/0"
BOGUS_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def rpm(limit: int, tenant: str = "a") -> Charge:
    return Charge(
        counter_name("tenant", "requests", tenant), "tenant_requests_per_minute", "requests", limit, 1
    )


def tpm(limit: int, cost: int, tenant: str = "a") -> Charge:
    return Charge(counter_name("tenant", "tokens", tenant), "tenant_tokens_per_minute", "tokens", limit, cost)


async def flush(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    prefix = f"{{test-quota-{uuid.uuid4().hex}}}:"
    yield prefix
    await flush(prefix)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[QuotaStore]:
    """Each store with a one-minute window; clock-free tests run against both."""
    made: QuotaStore
    if request.param == "memory":
        made = MemoryQuotaStore(clock=FakeClock(30.0))  # half-way through bucket 0
    else:
        made = RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix)
    yield made
    await made.aclose()


# --- both stores -----------------------------------------------------------------------------------


async def test_reserve_charges_every_counter_and_settle_corrects_tokens(store: QuotaStore) -> None:
    charges = [rpm(10), tpm(1000, 300)]
    reservation = await store.reserve("a", charges, 300)
    assert isinstance(reservation, Reservation)
    assert (await store.usage(charges[0].counter))[0] == 1
    assert (await store.usage(charges[1].counter))[0] == 300
    await store.settle(reservation, 120)  # the request really used 120 tokens
    assert (await store.usage(charges[0].counter))[0] == 1  # it was served: the request stays counted
    assert (await store.usage(charges[1].counter))[0] == 120


async def test_release_gives_back_request_and_tokens(store: QuotaStore) -> None:
    charges = [rpm(10), tpm(1000, 300)]
    reservation = await store.reserve("a", charges, 300)
    assert isinstance(reservation, Reservation)
    await store.release(reservation)
    assert await store.usage(charges[0].counter) == (0, 0)
    assert await store.usage(charges[1].counter) == (0, 0)


async def test_requests_over_the_limit_are_denied_with_a_wait(store: QuotaStore) -> None:
    for _ in range(3):
        assert isinstance(await store.reserve("a", [rpm(3)], 1), Reservation)
    denial = await store.reserve("a", [rpm(3)], 1)
    assert isinstance(denial, Denial)
    assert denial.charge.reason == "tenant_requests_per_minute"
    assert denial.in_use == 3
    assert denial.retry_after_s is not None and 0 < denial.retry_after_s <= 120


async def test_a_denial_charges_nothing_anywhere(store: QuotaStore) -> None:
    """All or nothing: the tokens window has no room, so the requests window is not charged either."""
    assert isinstance(await store.reserve("a", [rpm(10), tpm(100, 80)], 80), Reservation)
    denial = await store.reserve("a", [rpm(10), tpm(100, 80)], 80)
    assert isinstance(denial, Denial) and denial.charge.metric == "tokens"
    assert (await store.usage(rpm(10).counter))[0] == 1
    assert (await store.usage(tpm(100, 0).counter))[0] == 80


async def test_a_request_larger_than_the_limit_can_never_be_admitted(store: QuotaStore) -> None:
    denial = await store.reserve("a", [tpm(100, 101)], 101)
    assert isinstance(denial, Denial) and denial.retry_after_s is None


async def test_tenants_have_separate_counters(store: QuotaStore) -> None:
    assert isinstance(await store.reserve("a", [rpm(1, "a")], 1), Reservation)
    assert isinstance(await store.reserve("a", [rpm(1, "a")], 1), Denial)
    assert isinstance(await store.reserve("b", [rpm(1, "b")], 1), Reservation)


# --- the sliding window, on the memory store's clock --------------------------------------------------


async def test_the_window_slides_over_the_previous_bucket() -> None:
    clock = FakeClock(30.0)  # bucket 0, half gone
    store = MemoryQuotaStore(clock=clock)
    for _ in range(10):
        assert isinstance(await store.reserve("a", [rpm(10)], 1), Reservation)
    denial = await store.reserve("a", [rpm(10)], 1)
    assert isinstance(denial, Denial)
    # The current bucket must become the previous one (30 s), then decay to 9 of 10: 10 % of 60 s more.
    assert denial.retry_after_s == pytest.approx(36.0)
    clock.now = 65.0  # bucket 1, 1/12 gone: 10 × 11/12 ≈ 9.17 in use, no room yet
    assert isinstance(await store.reserve("a", [rpm(10)], 1), Denial)
    clock.now = 66.0  # 10 × 0.9 = 9 in use: room for one
    assert isinstance(await store.reserve("a", [rpm(10)], 1), Reservation)
    assert isinstance(await store.reserve("a", [rpm(10)], 1), Denial)
    clock.now = 180.0  # two buckets on: everything has expired
    assert await store.usage(rpm(10).counter) == (0, 0)


async def test_a_burst_at_the_bucket_boundary_gets_no_second_quota() -> None:
    clock = FakeClock(59.0)
    store = MemoryQuotaStore(clock=clock)
    admitted = 0
    for _ in range(10):
        admitted += isinstance(await store.reserve("a", [rpm(10)], 1), Reservation)
    clock.now = 61.0  # just over the boundary: the previous bucket still weighs 59/60
    for _ in range(10):
        admitted += isinstance(await store.reserve("a", [rpm(10)], 1), Reservation)
    assert admitted == 10


async def test_settling_after_the_window_moved_corrects_the_previous_bucket() -> None:
    clock = FakeClock(50.0)
    store = MemoryQuotaStore(clock=clock)
    reservation = await store.reserve("a", [tpm(1000, 500)], 500)
    assert isinstance(reservation, Reservation)
    clock.now = 70.0
    await store.reserve("a", [tpm(1000, 10)], 10)  # rolls the counter: 500 is now the previous bucket
    await store.settle(reservation, 100)
    assert await store.usage(tpm(1000, 0).counter) == (10, 100)
    clock.now = 130.0  # the reservation's bucket no longer counts: settling it changes nothing
    await store.settle(reservation, 0)
    assert await store.usage(tpm(1000, 0).counter) == (0, 10)


def test_wait_formula() -> None:
    assert wait_s(10, 1, current=5, previous=10, elapsed=0.5, window_s=60) == pytest.approx(0.1 * 60)
    assert wait_s(10, 1, current=10, previous=0, elapsed=0.25, window_s=60) == pytest.approx(51.0)
    assert wait_s(10, 11, current=0, previous=0, elapsed=0.0, window_s=60) is None


# --- Redis specifics -----------------------------------------------------------------------------------


async def test_redis_reservations_from_many_clients_admit_exactly_the_limit(redis_prefix: str) -> None:
    """The script checks and charges atomically: 60 concurrent reservations over 3 clients, limit 25."""
    stores = [RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(stores[i % 3].reserve("a", [rpm(25), tpm(10_000, 7)], 7) for i in range(60))
        )
        assert sum(isinstance(r, Reservation) for r in results) == 25
        assert (await stores[0].usage(tpm(10_000, 0).counter))[0] == 25 * 7
    finally:
        for s in stores:
            await s.aclose()


async def redis_now_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_redis_window_moves_on_with_redis_time(redis_prefix: str) -> None:
    """The wait a denial names is computed on Redis's clock, and once Redis's clock has moved on by it
    the tenant is admitted again. Checked against Redis TIME read around the calls, not against how
    long the calls took: two admissions then a denial, all in one 1 s bucket."""
    window_ms = 1000
    store = RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix, window_s=window_ms / 1000)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for attempt in range(10):  # a fresh tenant per attempt, until one attempt fits in one bucket
            tenant = f"t{attempt}"
            start_ms = await redis_now_ms(client)
            admitted = [await store.reserve(tenant, [rpm(2, tenant)], 1) for _ in range(2)]
            denial = await store.reserve(tenant, [rpm(2, tenant)], 1)
            end_ms = await redis_now_ms(client)
            if start_ms // window_ms == end_ms // window_ms:
                break
        else:
            pytest.fail("ten attempts in a row straddled a bucket boundary of Redis time")
        assert all(isinstance(r, Reservation) for r in admitted)
        assert isinstance(denial, Denial) and denial.retry_after_s is not None
        # Two in the current bucket, limit 2: room for one more once the bucket is the previous one and
        # has decayed to half, at 1.5 windows past the bucket's start on Redis's clock. The denial came
        # between start_ms and end_ms, so the wait it names lies between these two.
        room_at_ms = start_ms - start_ms % window_ms + 1.5 * window_ms
        retry_after_ms = denial.retry_after_s * 1000
        assert room_at_ms - end_ms - 1 <= retry_after_ms <= room_at_ms - start_ms + 1, (denial, start_ms)
        again = await store.reserve(tenant, [rpm(2, tenant)], 1)
        if await redis_now_ms(client) < room_at_ms:  # certainly asked before the room came back
            assert isinstance(again, Denial)
        deadline = time.monotonic() + 10
        while await redis_now_ms(client) < room_at_ms:  # wait for Redis's clock, not ours
            assert time.monotonic() < deadline, "Redis TIME did not reach the named wait within 10 s"
            await asyncio.sleep(0.02)
        assert isinstance(await store.reserve(tenant, [rpm(2, tenant)], 1), Reservation)
        ttl_ms = await client.pttl(store.key(rpm(2, tenant).counter))
        assert 0 < ttl_ms <= 2 * window_ms  # counters expire after two windows
    finally:
        await client.aclose()
        await store.aclose()


async def test_tenant_ids_cannot_spell_another_tenants_key() -> None:
    assert counter_name("tenant", "tokens", "a:tokens") != counter_name("tenant", "tokens", "a")
    assert ":" not in counter_name("tenant", "tokens", "x:y").split(":", 1)[1].rsplit(":", 1)[0]


# --- the Quotas policy ---------------------------------------------------------------------------------


def config(**kwargs: object) -> QuotasConfig:
    return QuotasConfig.model_validate(kwargs)


def test_charges_follow_tenant_overrides_then_defaults_then_global() -> None:
    cfg = config(
        default_requests_per_minute=60,
        default_tokens_per_minute=6000,
        global_tokens_per_minute=100_000,
        tenants={"vip": TenantQuota(requests_per_minute=600)},
    )
    quotas = Quotas(cfg, MemoryQuotaStore(), LimitsMetrics())
    vip = {c.reason: (c.limit, c.cost) for c in quotas.charges("vip", 50)}
    assert vip == {
        "tenant_requests_per_minute": (600, 1),
        "tenant_tokens_per_minute": (6000, 50),
        "global_tokens_per_minute": (100_000, 50),
    }
    other = {c.reason: c.limit for c in quotas.charges("other", 50)}
    assert other["tenant_requests_per_minute"] == 60
    assert Quotas(config(), MemoryQuotaStore(), LimitsMetrics()).charges("x", 5) == ()


async def test_over_quota_raises_429_with_retry_after_and_counts_it() -> None:
    metrics = LimitsMetrics()
    quotas = Quotas(config(default_tokens_per_minute=100), MemoryQuotaStore(clock=FakeClock(0.0)), metrics)
    first = await quotas.reserve("a", 80)
    with pytest.raises(RateLimitedError) as caught:
        await quotas.reserve("a", 30)
    error = caught.value
    assert error.status == 429 and error.metric == "tokens"
    assert error.retry_after_s >= 1
    wire = error.wire_error()
    assert wire.headers["Retry-After"] == str(error.retry_after_s)
    assert wire.body()["error"]["code"] == "rate_limit_exceeded"
    assert "in use 80" in str(error) and "requested 30" in str(error)
    assert metrics.rejections.labels(tenant="a", reason="tenant_tokens_per_minute")._value.get() == 1
    await quotas.settle(first, 20)  # the first request used far less: room comes back at once
    second = await quotas.reserve("a", 30)
    await quotas.release(second)


async def test_reserved_gauges_return_to_zero() -> None:
    metrics = LimitsMetrics()
    quotas = Quotas(config(default_tokens_per_minute=10_000), MemoryQuotaStore(), metrics)
    held = [await quotas.reserve("a", 100) for _ in range(3)]
    assert metrics.open_reservations._value.get() == 3
    assert metrics.reserved_tokens._value.get() == 300
    await quotas.settle(held[0], 40)
    await quotas.release(held[1])
    await quotas.settle(held[2], 100)
    assert metrics.open_reservations._value.get() == 0
    assert metrics.reserved_tokens._value.get() == 0


async def test_redis_down_from_the_start_fails_open_to_this_process_share_of_the_limits() -> None:
    """No replica was ever seen alive: each limit is divided by quotas.fallback_replicas."""
    metrics = LimitsMetrics()
    store = RedisQuotaStore.from_url(BOGUS_REDIS_URL, key_prefix="{unused}:")
    cfg = config(backend="redis", fail_open=True, fallback_replicas=2, default_requests_per_minute=4)
    quotas = Quotas(cfg, store, metrics)
    try:
        admitted = [await quotas.reserve("a", 10) for _ in range(2)]  # 4 per minute / 2 replicas
        assert all(r.local and r.charges for r in admitted)
        with pytest.raises(RateLimitedError) as caught:
            await quotas.reserve("a", 10)
        assert "limit 2" in str(caught.value)
        await quotas.release(admitted[0])  # back to this process's store, not the dead one
        await quotas.settle(admitted[1], 5)
        assert metrics.store_errors.labels(operation="release", outcome="lost")._value.get() == 0
        assert metrics.store_errors.labels(operation="settle", outcome="lost")._value.get() == 0
        again = await quotas.reserve("a", 10)  # the released request came back
        await quotas.release(again)
        assert metrics.store_errors.labels(operation="reserve", outcome="fallback")._value.get() == 4
        assert metrics.open_reservations._value.get() == 0
    finally:
        await quotas.aclose()


async def test_fail_open_divides_by_the_replicas_last_seen_alive_in_redis(redis_prefix: str) -> None:
    """Three codec replicas beat into Redis; when it goes, each admits a third of the limit."""
    clock = FakeClock(1000.0)
    cfg = config(backend="redis", fail_open=True, fallback_replicas=10, default_requests_per_minute=9)
    replicas = [
        Quotas(
            cfg, RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix), LimitsMetrics(), clock=clock
        )
        for _ in range(3)
    ]
    try:
        for quotas in replicas:
            await quotas.release(await quotas.reserve("a", 1))
        assert [q.replicas_seen for q in replicas] == [1, 2, 3]  # each saw those that beat before it
        clock.now += 10.0  # the next heartbeat is due
        first = replicas[0]
        await first.release(await first.reserve("a", 1))
        assert first.replicas_seen == 3
        await first.store.aclose()
        first.store = RedisQuotaStore.from_url(BOGUS_REDIS_URL, key_prefix=redis_prefix)
        first.fallback = MemoryQuotaStore(clock=clock)
        held = [await first.reserve("a", 1) for _ in range(3)]  # 9 / 3
        with pytest.raises(RateLimitedError):
            await first.reserve("a", 1)
        for reservation in held:
            await first.release(reservation)
    finally:
        for quotas in replicas:
            await quotas.aclose()


async def test_redis_down_with_a_memory_backend_has_no_share_to_compute() -> None:
    """A memory store is never down; fail_open only matters over Redis (no fallback store here)."""
    quotas = Quotas(
        config(fail_open=True, default_requests_per_minute=1), MemoryQuotaStore(), LimitsMetrics()
    )
    assert quotas.fallback is None
    await quotas.release(await quotas.reserve("a", 1))


def counting_connection(attempts: list[str]) -> type[aioredis.Connection]:
    """A redis-py connection class that records each attempt to open a socket."""

    class CountingConnection(aioredis.Connection):
        async def _connect(self) -> None:
            attempts.append(f"{self.host}:{self.port}")
            await super()._connect()

    return CountingConnection


async def test_redis_down_fails_closed_with_503_and_retries_only_after_an_interval() -> None:
    metrics = LimitsMetrics()
    attempts: list[str] = []
    clock = FakeClock(100.0)
    client = aioredis.Redis.from_url(
        BOGUS_REDIS_URL, connection_class=counting_connection(attempts), socket_connect_timeout=1.0
    )
    store = RedisQuotaStore(client, key_prefix="{unused}:", retry_interval_s=30.0, clock=clock)
    quotas = Quotas(config(backend="redis", fail_open=False, default_requests_per_minute=5), store, metrics)
    try:
        with pytest.raises(QuotaUnavailableError) as caught:
            await quotas.reserve("a", 10)
        assert caught.value.wire_error().status == 503
        assert caught.value.headers["Retry-After"] == "1"
        assert attempts, "the first reservation never tried to reach Redis"
        num_attempts = len(attempts)
        clock.now += 29.0
        with pytest.raises(QuotaUnavailableError):
            await quotas.reserve("a", 10)  # cooling down: refused without another connection attempt
        assert len(attempts) == num_attempts, attempts
        assert metrics.store_errors.labels(operation="reserve", outcome="refused")._value.get() == 2
        assert metrics.rejections.labels(tenant="a", reason="quota_store_down")._value.get() == 2
        clock.now += 1.0  # the interval is over: the next reservation tries Redis again
        with pytest.raises(QuotaUnavailableError):
            await quotas.reserve("a", 10)
        assert len(attempts) > num_attempts
        assert metrics.open_reservations._value.get() == 0
    finally:
        await quotas.aclose()


async def test_a_lost_settlement_is_counted_not_raised(redis_prefix: str) -> None:
    metrics = LimitsMetrics()
    store = RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix)
    quotas = Quotas(config(backend="redis", default_tokens_per_minute=1000), store, metrics)
    reservation = await quotas.reserve("a", 100)
    await store.aclose()
    dead = RedisQuotaStore.from_url(BOGUS_REDIS_URL, key_prefix=redis_prefix)
    quotas.store = dead
    try:
        await quotas.settle(reservation, 10)  # must not raise: it runs in cleanup
        assert metrics.store_errors.labels(operation="settle", outcome="lost")._value.get() == 1
    finally:
        await dead.aclose()


async def test_redis_quota_shared_by_two_policies_is_one_quota(redis_prefix: str) -> None:
    """Two codecs' Quotas over one Redis admit the tenant's limit together."""
    cfg = config(backend="redis", default_requests_per_minute=7)
    pair = [
        Quotas(cfg, RedisQuotaStore.from_url(REDIS_URL, key_prefix=redis_prefix), LimitsMetrics())
        for _ in range(2)
    ]
    admitted = 0
    try:
        for i in range(20):
            try:
                await pair[i % 2].reserve("shared", 1)
                admitted += 1
            except RateLimitedError:
                pass
        assert admitted == 7
    finally:
        for q in pair:
            await q.aclose()
