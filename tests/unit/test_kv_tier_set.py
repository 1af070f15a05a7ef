"""Reading a request's segments through the tiers (fastest first, each behind its breaker) and writing them
on a thread of their own (services/kvcache/tier_set.py). A dict stands in for a store where the real ones
are not the point; the disk tier is the real one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from services.kvcache.disk_tier import DiskTier
from services.kvcache.host_tier import HostTier
from services.kvcache.segment import SegmentMiss
from services.kvcache.tier import Breaker, TierUnavailable
from services.kvcache.tier_set import Hold, SegmentRef, SegmentSize, SegmentWriter, TierSet

NS = "0123456789abcdef"
KEYS = [f"kv1:{NS}:-:{i:064x}" for i in range(4)]
SIZE = SegmentSize(num_bytes=5, num_tokens=32)


class DictTier:
    """A store in a dict, or one that is down (`is_down`): a seam, not a backend."""

    def __init__(self, name: str, outlives_worker: bool = True) -> None:
        self.name = name
        self.outlives_worker = outlives_worker
        self.evictions = 0
        self.values: dict[str, bytes] = {}
        self.ttls: dict[str, int | None] = {}  # the lifetime each put asked for, the last one
        self.ttl_s = None
        self.is_down = False
        self.num_calls = 0

    def _answer(self) -> None:
        self.num_calls += 1
        if self.is_down:
            raise TierUnavailable(f"{self.name} is down")

    def get(self, key: str) -> bytes | None:
        self._answer()
        return self.values.get(key)

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        self._answer()
        self.ttls[key] = ttl_s
        return self.values.setdefault(key, value) is value

    def contains(self, keys: list[str]) -> list[bool]:
        self._answer()
        return [key in self.values for key in keys]

    def used_bytes(self) -> int | None:
        return sum(len(v) for v in self.values.values())

    def take_evicted(self) -> list[str]:
        return []

    def delete(self, key: str) -> None:
        self._answer()
        self.values.pop(key, None)


def check(index: int, value: bytes) -> bytes:
    if not value.startswith(b"good"):
        raise SegmentMiss("checksum differs")
    return value[4:]


def far() -> float:
    return time.monotonic() + 60


def test_the_run_is_the_longest_prefix_found_across_the_tiers(tmp_path: Path) -> None:
    disk, shared = DiskTier(tmp_path, 1 << 20), DictTier("shared")
    disk.put(KEYS[0], b"good0")
    shared.values[KEYS[1]] = b"good1"
    shared.values[KEYS[3]] = b"good3"  # after a gap: never reached
    tiers = TierSet([disk, shared])
    assert tiers.fetch(KEYS, check, far(), SIZE) == [b"0", b"1"]
    assert tiers.stats.hits == {"disk": 1, "shared": 1}


def test_a_corrupted_value_is_deleted_and_the_next_tier_serves_it(tmp_path: Path) -> None:
    disk, shared = DiskTier(tmp_path, 1 << 20), DictTier("shared")
    disk.put(KEYS[0], b"bad!")
    shared.values[KEYS[0]] = b"good0"
    tiers = TierSet([disk, shared])
    assert tiers.fetch(KEYS[:1], check, far(), SIZE) == [b"0"]
    assert tiers.stats.corrupt["disk"] == 1
    assert disk.get(KEYS[0]) is None  # deleted: the next reader does not meet it again


def test_a_down_tier_opens_its_breaker_and_is_no_longer_asked() -> None:
    shared = DictTier("shared")
    shared.is_down = True
    now = [0.0]
    tiers = TierSet([shared], make_breaker=lambda: Breaker(2, cooldown_s=30, clock=lambda: now[0]))
    for _ in range(5):
        assert tiers.fetch(KEYS, check, far(), SIZE) == []  # the no-cache path: nothing fetched, no error
    assert shared.num_calls == 2  # then open: not asked
    assert tiers.stats.unavailable["shared"] == 5 and tiers.stats.misses["shared"] == 0
    shared.is_down = False
    shared.values[KEYS[0]] = b"good0"
    now[0] = 31  # the cooldown passed: one probe, which answers, closes the breaker
    assert tiers.fetch(KEYS, check, far(), SIZE) == [b"0"]
    assert not tiers.breakers["shared"].is_open


def test_a_passed_deadline_keeps_what_was_fetched() -> None:
    shared = DictTier("shared")
    shared.values.update({key: b"good" + bytes([i]) for i, key in enumerate(KEYS)})
    tiers = TierSet([shared])
    assert tiers.fetch(KEYS, check, time.monotonic() - 1, SIZE) == []
    assert shared.num_calls == 0


def test_the_writer_writes_every_tier_once_and_a_down_tier_does_not_stop_the_others(tmp_path: Path) -> None:
    disk, shared = DiskTier(tmp_path, 1 << 20), DictTier("shared")
    shared.is_down = True
    tiers = TierSet([disk, shared])
    writer = SegmentWriter(tiers)
    assert writer.submit(KEYS[0], 5, lambda: b"good0")
    assert not writer.submit(KEYS[0], 5, lambda: b"good0")  # written lately: not again
    assert writer.wait_idle(10)
    assert disk.get(KEYS[0]) == b"good0"
    assert tiers.stats.bytes_written["disk"] == 5 and tiers.stats.unavailable["shared"] == 1
    writer.close()


def test_a_write_held_in_memory_skips_the_lasting_tiers_and_a_longer_hold_writes_again() -> None:
    host, shared = DictTier("host", outlives_worker=False), DictTier("shared")
    writer = SegmentWriter(TierSet([host, shared]))
    assert writer.submit(KEYS[0], 5, lambda: b"good0", Hold(through=False))
    assert writer.wait_idle(10)
    assert KEYS[0] in host.values and KEYS[0] not in shared.values
    assert not writer.submit(KEYS[0], 5, lambda: b"good0", Hold(through=False))  # nothing to add
    assert writer.submit(KEYS[0], 5, lambda: b"good0", Hold(through=True, ttl_s=300))  # now through
    assert writer.wait_idle(10)
    assert shared.values[KEYS[0]] == b"good0" and shared.ttls[KEYS[0]] == 300
    assert not writer.knows(KEYS[0], Hold(through=True, ttl_s=3600))
    assert writer.knows(KEYS[0], Hold(through=False, ttl_s=60))
    assert writer.submit(KEYS[0], 5, lambda: b"good0", Hold(through=True, ttl_s=3600))  # a longer life
    assert writer.wait_idle(10)
    assert shared.ttls[KEYS[0]] == 3600
    writer.close()


def test_the_writer_drops_what_exceeds_its_byte_budget() -> None:
    shared = DictTier("shared")
    now = [0.0]
    writer = SegmentWriter(TierSet([shared]), bytes_per_s=100, clock=lambda: now[0])
    assert writer.submit(KEYS[0], 80, lambda: bytes(80))
    assert not writer.submit(KEYS[1], 80, lambda: bytes(80))  # 20 bytes left this second
    now[0] = 1.0
    assert writer.submit(KEYS[1], 80, lambda: bytes(80))  # refilled
    assert writer.wait_idle(10)
    assert writer.tiers.stats.writes_dropped == {"budget": 1}
    assert set(shared.values) == {KEYS[0], KEYS[1]}
    writer.close()


def test_the_writer_drops_when_its_queue_is_full() -> None:
    shared = DictTier("shared")
    gate = threading.Event()

    def slow_put(key: str, value: bytes, ttl_s: int | None = None) -> bool:
        gate.wait(10)  # holds the writer thread until the test opens the gate
        shared.values[key] = value
        return True

    shared.put = slow_put  # type: ignore[method-assign]
    writer = SegmentWriter(TierSet([shared]), max_queued=1)
    results = [writer.submit(key, 1, lambda: b"v") for key in KEYS]
    gate.set()
    assert writer.wait_idle(10)
    assert results[0] and not all(results)
    assert writer.tiers.stats.writes_dropped["queue"] >= 1
    writer.close()


@pytest.mark.parametrize("num_keys", [0, 1])
def test_an_empty_or_missing_run_is_empty(num_keys: int) -> None:
    assert TierSet([DictTier("shared")]).fetch(KEYS[:num_keys], check, far(), SIZE) == []


def test_writes_and_evictions_become_one_tier_event_per_segment_for_the_router() -> None:
    host, shared = HostTier(10), DictTier("shared")
    shared.ttl_s = 60  # type: ignore[assignment]
    tiers = TierSet([host, shared])
    first, second = (SegmentRef(bytes([i]) * 32, 4 * i, 4) for i in (1, 2))
    keys = [f"kv1:{'0' * 16}:-:{ref.last_block.hex()}" for ref in (first, second)]
    tiers.put(keys[0], b"8 bytes.", Hold(ttl_s=3600), first)
    tiers.put(keys[0], b"8 bytes.", Hold(ttl_s=30), first)  # again: one event, the last
    tiers.put(keys[1], b"8 bytes.", Hold(), second)  # the host tier (10 bytes) evicts the first
    events = {(e.tier, e.stored, e.last_block): e for e in tiers.take_events()}
    assert set(events) == {
        ("host", False, first.last_block),
        ("host", True, second.last_block),
        ("shared", True, first.last_block),
        ("shared", True, second.last_block),
    }
    assert events["shared", True, first.last_block].ttl_s == 3600  # the longer of the two writes
    assert (
        events["host", True, second.last_block].first_block,
        events["host", True, second.last_block].ttl_s,
    ) == (8, 0)
    assert tiers.take_events() == []


def test_a_key_written_long_ago_is_written_again_so_a_prefix_the_pool_serves_keeps_its_lifetime() -> None:
    now = [0.0]
    shared = DictTier("shared")
    writer = SegmentWriter(TierSet([shared]), refresh_s=100.0, clock=lambda: now[0])
    assert writer.submit(KEYS[0], 5, lambda: b"good0")
    assert not writer.submit(KEYS[0], 5, lambda: b"good0")
    now[0] = 150.0
    assert not writer.knows(KEYS[0]) and writer.submit(KEYS[0], 5, lambda: b"good0")  # its lifetime renewed
    assert writer.wait_idle(10)
    assert shared.num_calls == 2
    writer.close()
