"""Block pool: allocation, reference counts, prefix hits and LRU eviction."""

from __future__ import annotations

import pytest

from services.engine.scheduling.block_pool import BlockPool


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_allocate_takes_blocks_and_refuses_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.stats().num_active == 3
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_committed_block_is_found_and_verified_by_tokens() -> None:
    pool = BlockPool(4)
    [b] = pool.allocate(1) or []
    pool.commit(b, h(1), [5, 6])
    assert pool.lookup([h(1)], [[5, 6]]) == [b]
    assert pool.lookup([h(1)], [[5, 7]]) == []  # same hash, other tokens: never a hit


def test_freed_cached_block_stays_cached_until_evicted_lru_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3) or []
    for i, b in enumerate(blocks):
        pool.commit(b, h(i), [i])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    stats = pool.stats()
    assert (stats.num_cached, stats.num_free, stats.num_active) == (2, 0, 1)
    [reused] = pool.allocate(1) or []
    assert reused == blocks[0]  # least recently freed goes first
    assert pool.lookup([h(0)], [[0]]) == []
    assert pool.lookup([h(1)], [[1]]) == [blocks[1]]


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    pool.commit(a, h(9), [9])
    pool.free([a])
    pool.free([b])  # b has no hash: it goes to the front
    assert pool.allocate(1) == [b]


def test_touch_takes_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1) or []
    pool.commit(a, h(1), [1])
    pool.free([a])
    pool.touch([a])
    assert pool.num_available == 1
    pool.check_invariants({a: 1})


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1) or []
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])


def test_invariant_check_catches_a_leak() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="ref_cnt"):
        pool.check_invariants({})


def test_events_record_stored_and_removed_hashes() -> None:
    pool = BlockPool(1, record_events=True)
    [a] = pool.allocate(1) or []
    pool.commit(a, h(3), [3])
    pool.free([a])
    pool.allocate(1)
    assert [(e.kind, e.block_hash) for e in pool.events] == [("stored", h(3)), ("removed", h(3))]


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1) or []
    pool.commit(a, h(1), [1])
    assert pool.lookup([h(1)], [[1]]) == []
