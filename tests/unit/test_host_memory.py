"""`check_host_memory`: the engine refuses to start when its weights plus the planned KV cache exceed the
memory the host has available (MemAvailable), with a message that names both sizes and the knob."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import CapacityError
from services.engine.layers.kv_cache import _mem_available_bytes, cgroup_headroom_bytes, check_host_memory

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


def test_a_memory_cgroup_limit_caps_what_is_available(tmp_path: Path) -> None:
    """A container's limit (cgroup v2's memory.max or v1's limit_in_bytes) minus its usage; no limit, no
    cap. /proc/meminfo alone would show the host's memory inside a pod."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.current").write_text("268435456\n")
    assert cgroup_headroom_bytes(v2) == 768 * MB
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom_bytes(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("536870912\n")
    (v1 / "memory.usage_in_bytes").write_text("600000000\n")
    assert cgroup_headroom_bytes(tmp_path / "v1") == 0  # over its limit already: nothing left
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_headroom_bytes(tmp_path / "v1") is None
    assert cgroup_headroom_bytes(tmp_path / "none") is None
