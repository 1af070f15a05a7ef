"""`check_host_memory`: the engine refuses to start when its weights plus the planned KV cache exceed the
memory the host has available (MemAvailable), with a message that names both sizes and the knob."""

from __future__ import annotations

import pytest

from services.common.errors import CapacityError
from services.engine.kv_cache import _mem_available_bytes, check_host_memory

MB = 2**20


def available() -> int:
    got = _mem_available_bytes()
    assert got is not None and got > 64 * MB, "this host reports MemAvailable in /proc/meminfo"
    return got


def test_a_plan_beyond_available_memory_is_refused_with_both_sizes_and_the_knob() -> None:
    weights, kv = 300 * MB, available() + 4096 * MB  # 4 GB more than there is, whatever else runs
    with pytest.raises(CapacityError) as refused:
        check_host_memory(weights, kv)
    message = str(refused.value)
    assert "weights (300 MB)" in message
    assert f"KV cache ({kv / MB:.0f} MB)" in message
    assert "of memory available; lower engine.kv_cache_memory_mb" in message


def test_weights_alone_beyond_available_memory_are_refused_too() -> None:
    with pytest.raises(CapacityError, match=r"plus KV cache \(0 MB\) exceed"):
        check_host_memory(available() + 4096 * MB, 0)


def test_a_plan_within_available_memory_passes() -> None:
    half = available() // 2
    check_host_memory(half // 2, half // 2)
    check_host_memory(0, 0)
