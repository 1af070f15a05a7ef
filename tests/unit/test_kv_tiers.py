"""The tiers below a worker's pool (services/kvcache): the local-disk tier (bounded, shared by two workers,
a whole value or none), the shared tier on a Redis of its own role (started here, `allkeys-lru`, a
`maxmemory`, no persistence), one that never answers, and the breaker that stops asking a failing tier."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.kvcache.disk_tier import DiskTier
from services.kvcache.host_tier import HostTier
from services.kvcache.redis_tier import RedisTier, tenant_keys
from services.kvcache.tier import Breaker, TierUnavailable
from tests.kv_helpers import cache_redis_url
from tests.ports import free_port

NS = "0123456789abcdef"


def key(i: int, tenant: str = "-") -> str:
    return f"kv1:{NS}:{tenant}:{i:064x}"


def test_the_disk_tier_stores_once_and_reads_back(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert tier.get(key(1)) is None
    assert tier.put(key(1), b"segment one")
    assert not tier.put(key(1), b"segment one")  # content-addressed: the first writer wins
    assert tier.get(key(1)) == b"segment one"
    assert tier.contains([key(1), key(2)]) == [True, False]
    tier.delete(key(1))
    assert tier.get(key(1)) is None


def test_the_disk_tier_survives_a_restart_and_is_shared_by_two_workers(tmp_path: Path) -> None:
    DiskTier(tmp_path, capacity_bytes=1 << 20).put(key(1), b"written by worker 0")
    other = DiskTier(tmp_path, capacity_bytes=1 << 20)  # a second worker, or the first one restarted
    assert other.get(key(1)) == b"written by worker 0"
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written file left behind


def test_the_disk_tier_evicts_least_recently_used_down_to_its_capacity(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=3500)
    for i in range(3):
        tier.put(key(i), bytes(1000))
        stamp = 1_000_000 + i
        os.utime(next(tmp_path.rglob(f"*{i:064x}*")), (stamp, stamp))
    assert tier.get(key(0)) == bytes(1000)  # a hit: key 0 is now the most recently used
    assert tier.used_bytes() == 3000
    tier.put(key(3), bytes(1000))  # over capacity: the least recently used (key 1) goes
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert tier.used_bytes() <= 3500


def test_the_host_tier_stores_once_and_drops_least_recently_used_past_its_capacity() -> None:
    tier = HostTier(capacity_bytes=3000)
    assert tier.put(key(1), b"a" * 1000) and not tier.put(key(1), b"b" * 1000)  # the first writer wins
    assert tier.put(key(2), b"c" * 1000) and tier.put(key(3), b"d" * 1000)
    assert tier.get(key(1)) == b"a" * 1000  # a hit: now the most recently used
    assert tier.put(key(4), b"e" * 1000)  # over capacity: key 2 goes, not key 1
    assert tier.contains([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    assert (tier.used_bytes(), tier.evictions) == (3000, 1)
    assert not tier.put(key(5), b"f" * 3001)  # larger than the tier: never stored, nothing evicted
    tier.delete(key(3))
    assert tier.used_bytes() == 2000 and tier.get(key(3)) is None


def test_a_key_that_is_not_a_segment_key_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for bad in ("../../etc/passwd", f"kv1:{NS}:-:../x", "kv1:a:b"):
        with pytest.raises(ValueError):
            tier.get(bad)


@pytest.fixture(scope="module")
def cache_redis() -> Iterator[str]:
    """A Redis of the shared tier's role: LRU over a small maxmemory, persistence off."""
    with cache_redis_url(2) as url:
        yield url


def test_the_shared_tier_stores_once_refreshes_on_a_hit_and_expires(cache_redis: str) -> None:
    tier = RedisTier.from_url(cache_redis, ttl_s=60, timeout_s=1.0)
    tier.client.flushdb()
    assert tier.get(key(1)) is None
    assert tier.put(key(1), b"shared segment")
    assert not tier.put(key(1), b"shared segment")
    tier.client.expire(key(1), 5)
    assert tier.get(key(1)) == b"shared segment"
    assert tier.client.ttl(key(1)) > 5  # the hit restored the full TTL
    assert tier.contains([key(1), key(2)]) == [True, False]
    tier.delete(key(1))
    assert tier.contains([key(1)]) == [False]
    tier.close()


@pytest.mark.parametrize("tenant_capacity_bytes", [0, 1 << 20])
def test_a_longer_lifetime_asked_extends_a_segment_and_nothing_shortens_it(
    cache_redis: str, tenant_capacity_bytes: int
) -> None:
    tier = RedisTier.from_url(cache_redis, 60, 1.0, tenant_capacity_bytes=tenant_capacity_bytes)
    tier.client.flushdb()
    assert tier.put(key(1), b"5m", ttl_s=30)  # shorter than the tier's own: the tier's
    assert 30 < tier.client.ttl(key(1)) <= 60
    assert not tier.put(key(1), b"5m", ttl_s=86_400)  # stored already: its lifetime grows
    assert tier.client.ttl(key(1)) > 86_000
    assert not tier.put(key(1), b"5m", ttl_s=300)
    assert tier.get(key(1)) == b"5m"
    assert tier.client.ttl(key(1)) > 86_000  # neither a shorter write nor a hit shortens it
    if tenant_capacity_bytes:  # the tenant's count lives as long as its longest segment
        index, _, count = tenant_keys(key(1))
        assert tier.client.ttl(index) > 86_000 and tier.client.ttl(count) > 86_000
    tier.close()


def test_the_shared_tier_drops_least_recently_used_under_its_maxmemory(cache_redis: str) -> None:
    tier = RedisTier.from_url(cache_redis, ttl_s=60, timeout_s=1.0)
    tier.client.flushdb()
    for i in range(40):  # 40 x 100 KB in 2 MB
        assert tier.put(key(i), bytes(100_000))
    kept = tier.contains([key(i) for i in range(40)])
    assert not all(kept) and kept[-1]  # old segments went, the newest stayed
    tier.close()


def test_a_tenant_over_its_cap_loses_its_own_least_recently_used_segments_only(cache_redis: str) -> None:
    tier = RedisTier.from_url(cache_redis, ttl_s=60, timeout_s=1.0, tenant_capacity_bytes=3000)
    tier.client.flushdb()
    a, b = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
    assert tier.put(key(100, b), bytes(1000))  # tenant B: under its cap
    for i in range(3):
        assert tier.put(key(i, a), bytes(1000))  # tenant A: at its cap
    assert tier.get(key(0, a)) is not None  # A's first segment is now its most recent
    assert tier.put(key(3, a), bytes(1000))  # over: A's least recently used (key 1) goes
    assert tier.contains([key(i, a) for i in range(4)]) == [True, False, True, True]
    assert tier.contains([key(100, b)]) == [True]  # never another tenant's
    assert (tier.tenant_bytes(a), tier.tenant_bytes(b), tier.evictions) == (3000, 1000, 1)
    assert tier.take_evicted() == [key(1, a)] and tier.take_evicted() == []  # for the KV events
    tier.delete(key(3, a))  # a refused value leaves the count too
    assert tier.tenant_bytes(a) == 2000 and tier.contains([key(3, a)]) == [False]
    assert not tier.put(key(0, a), bytes(1000)) and tier.tenant_bytes(a) == 2000  # stored once, counted once
    tier.close()


def test_a_stopped_shared_tier_is_unavailable_not_an_error() -> None:
    tier = RedisTier.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60, timeout_s=0.5)
    with pytest.raises(TierUnavailable):
        tier.get(key(1))
    with pytest.raises(TierUnavailable):
        tier.put(key(1), b"x")


def test_a_shared_tier_that_accepts_but_never_answers_ends_at_its_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    tier = RedisTier.from_url(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", ttl_s=60, timeout_s=0.3)
    with pytest.raises(TierUnavailable) as raised:
        tier.get(key(1))
    assert isinstance(raised.value.__cause__, redis.TimeoutError)  # ended by the socket timeout, not a hang
    listener.close()
    for conn in accepted:
        conn.close()


def test_the_breaker_opens_after_failures_and_closes_when_the_tier_answers() -> None:
    now = [0.0]
    breaker = Breaker(failure_threshold=2, cooldown_s=10, clock=lambda: now[0])
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.allow()
    breaker.record_failure()
    assert not breaker.allow()  # open: the tier is not asked
    now[0] = 11
    assert breaker.allow()  # half-open: one probe
    breaker.record_failure()
    assert not breaker.allow()  # the probe failed: a full cooldown again
    now[0] = 22
    assert breaker.allow()
    breaker.record_success()
    assert breaker.allow() and breaker.num_failures == 0
