"""The GPU KV plan over a CPU twin of a device: engines built one after another in one process are each
charged what they hold, not the process's reservations, and the allocator's unused cache counts as free."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common.errors import CapacityError
from services.engine.loading.device import (
    GIB,
    MIB,
    MemoryReading,
    account_engine_memory,
    check_weights_fit,
    measure_device_memory,
    plan_device_blocks,
    read_memory,
)

BLOCK_BYTES = 2 * MIB  # Llama-3.1-8B's 16-token block in bf16
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
CHUNK = 2 * MIB  # the allocator reserves from the device in chunks of this


@dataclass
class SimulatedDevice:
    """A device and this process's caching allocator (a MemoryProbe): allocations take from the cache
    first and reserve what is missing from the device in chunks; freed memory stays reserved. The CUDA
    context is created before any reading, and the first kernel launch loads `module_bytes` outside the
    allocator, once per process."""

    total_bytes: int
    context_bytes: int = GIB // 2
    module_bytes: int = GIB // 2
    other_bytes: int = 0  # held by other processes
    allocated: int = 0
    reserved: int = 0
    peak: int = 0
    modules_loaded: bool = False

    def mem_get_info(self) -> tuple[int, int]:
        used = self.context_bytes + self.other_bytes + self.reserved
        used += self.module_bytes if self.modules_loaded else 0
        return self.total_bytes - used, self.total_bytes

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def malloc(self, num_bytes: int) -> int:
        missing = num_bytes - (self.reserved - self.allocated)
        if missing > 0:
            grow = -(-missing // CHUNK) * CHUNK
            if grow > self.mem_get_info()[0]:
                raise MemoryError(f"out of device memory: {num_bytes} bytes")
            self.reserved += grow
        self.allocated += num_bytes
        self.peak = max(self.peak, self.allocated)
        return num_bytes

    def free(self, num_bytes: int) -> None:
        self.allocated -= num_bytes

    def launch(self) -> None:
        self.modules_loaded = True


@dataclass
class SimulatedEngine:
    num_blocks: int
    held: list[int] = field(default_factory=list)

    def drop(self, device: SimulatedDevice) -> None:
        for num_bytes in self.held:
            device.free(num_bytes)
        self.held.clear()


def build_engine(
    device: SimulatedDevice,
    utilization: float,
    weight_bytes: int = 2 * GIB,
    activation_bytes: int = GIB,
    scratch_bytes: int = 256 * MIB,
) -> SimulatedEngine:
    """factory.build_core's steps on the twin: read, check the weights, place them, warm up, plan, and
    allocate the KV cache."""
    before_load = read_memory(device)
    check_weights_fit(weight_bytes, before_load.total_bytes, before_load.available_bytes, utilization)
    weights = device.malloc(weight_bytes)

    def warm_up() -> int:
        scratch = device.malloc(scratch_bytes)
        device.launch()
        device.free(device.malloc(activation_bytes))
        device.free(scratch)
        return scratch_bytes

    memory = measure_device_memory(device, warm_up, weight_bytes, before_load)
    num_blocks = plan_device_blocks(BLOCK_BYTES, BLOCK_SIZE, memory, utilization, MAX_MODEL_LEN)
    return SimulatedEngine(num_blocks, [weights, device.malloc(num_blocks * BLOCK_BYTES)])


def blocks_for(total_bytes: int, utilization: float, engine_bytes: int) -> int:
    return (int(total_bytes * utilization) - engine_bytes) // BLOCK_BYTES


def test_a_second_engine_beside_the_first_is_sized_by_its_own_needs() -> None:
    device = SimulatedDevice(total_bytes=80 * GIB)
    first = build_engine(device, 0.45)
    second = build_engine(device, 0.45)
    # Each pays its weights and activations; the first also the kernel modules the process loaded.
    assert first.num_blocks == blocks_for(80 * GIB, 0.45, 3 * GIB + device.module_bytes)
    assert second.num_blocks == blocks_for(80 * GIB, 0.45, 3 * GIB)
    assert device.reserved <= device.total_bytes - device.context_bytes - device.module_bytes


def test_an_engine_after_a_dropped_one_gets_the_whole_share_from_the_allocators_cache() -> None:
    device = SimulatedDevice(total_bytes=80 * GIB)
    first = build_engine(device, 0.9)
    first.drop(device)
    reserved = device.reserved
    assert device.allocated == 0 and reserved > 60 * GIB  # freed, but still held by the allocator
    second = build_engine(device, 0.9)
    assert second.num_blocks == blocks_for(80 * GIB, 0.9, 3 * GIB)
    assert second.num_blocks > first.num_blocks
    # Placed in the cache: reserved anew only the KV the first engine's modules had taken from its share.
    assert device.reserved - reserved == device.module_bytes


def test_an_engine_beyond_the_true_free_memory_is_refused_with_figures() -> None:
    device = SimulatedDevice(total_bytes=80 * GIB)
    build_engine(device, 0.6)
    with pytest.raises(CapacityError) as refused:
        build_engine(device, 0.6)
    text = str(refused.value)
    assert "engine.gpu_memory_utilization=0.6 plans 45.00 GiB of KV" in text
    assert "of the device is free: another process holds" in text
    assert "or engines built earlier in this one do; lower engine.gpu_memory_utilization" in text


def test_memory_the_allocator_caches_unused_counts_as_free() -> None:
    start = MemoryReading(free_bytes=70 * GIB, total_bytes=80 * GIB, allocated_bytes=0, reserved_bytes=0)
    # 2 GiB of weights and 1 GiB of activations placed; 40 GiB cached from an engine freed before it.
    now = MemoryReading(
        free_bytes=4 * GIB, total_bytes=80 * GIB, allocated_bytes=2 * GIB, reserved_bytes=66 * GIB
    )
    memory = account_engine_memory(start, now, 2 * GIB, GIB)
    assert memory.engine_bytes == 3 * GIB
    assert memory.free_bytes == 4 * GIB + 64 * GIB - GIB
    assert plan_device_blocks(BLOCK_BYTES, BLOCK_SIZE, memory, 0.8, MAX_MODEL_LEN) == blocks_for(
        80 * GIB, 0.8, 3 * GIB
    )
    assert now.available_bytes == 68 * GIB
    check_weights_fit(60 * GIB, now.total_bytes, now.available_bytes, 0.9)


def test_memory_the_device_lost_outside_the_allocator_is_the_engines() -> None:
    start = MemoryReading(free_bytes=70 * GIB, total_bytes=80 * GIB, allocated_bytes=0, reserved_bytes=0)
    # 3 GiB reserved (weights, cached activations) and 1 GiB of CUDA modules loaded during the build.
    now = MemoryReading(
        free_bytes=66 * GIB, total_bytes=80 * GIB, allocated_bytes=2 * GIB, reserved_bytes=3 * GIB
    )
    memory = account_engine_memory(start, now, 2 * GIB, GIB)
    assert memory.engine_bytes == 2 * GIB + GIB + GIB
    assert memory.free_bytes == 66 * GIB + GIB - GIB


def test_the_activations_are_the_peak_over_the_live_bytes_less_the_scratch_cache() -> None:
    device = SimulatedDevice(total_bytes=80 * GIB, module_bytes=0)
    device.malloc(5 * GIB)  # an earlier engine's tensors, still alive

    def warm_up() -> int:
        scratch = device.malloc(300 * MIB)
        device.free(device.malloc(700 * MIB))
        device.free(scratch)
        return 300 * MIB

    weights = device.malloc(2 * GIB)
    memory = measure_device_memory(device, warm_up, 2 * GIB)
    assert weights and memory.engine_bytes == 2 * GIB + 700 * MIB
