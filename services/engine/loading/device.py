"""Where the engine runs: the `engine.device` setting resolved, the dtypes for that device, and the KV plan.

On a CPU the KV cache is sized by `engine.kv_cache_memory_mb` (kv_cache.plan_num_blocks). On a GPU it
takes what is left of the engine's share of the device, `engine.gpu_memory_utilization` of its total
memory, once the weights are in place and a warm-up step has run: the same rule vLLM users know. The share
is per engine, and only what this engine holds is charged to it (account_engine_memory), so engines built
one after another in one process are each sized by their own needs. The device's figures come through a
MemoryProbe, so the planning runs on a simulated device in CPU tests.
Processes that share one device (`kvrelay up` on one GPU, the colocated tests) split the device between
them, and together may ask for at most MAX_SHARED_UTILIZATION of it, so the CUDA context, NCCL and
fragmentation keep room. Every refusal names the figures and the setting to change (exit 78).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.errors import CapacityError, ConfigError

MAX_SHARED_UTILIZATION = 0.95
# A step's token budget when `engine.max_num_batched_tokens` is unset: a 256-token chunk is about a
# second of prefill on a 2-core CPU (under limits.step_timeout_ms); a GPU wants large chunks to fill it.
DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}
# Sequences in one step when `limits.batch_size_limit` is unset: 32 keeps a 2-core CPU's step under a
# second; a GPU's decode step costs about the same from 1 to a few hundred rows (it reads the weights
# once), so it takes 256, as vLLM's max_num_seqs does.
DEFAULT_BATCH_SIZE_LIMIT = {"cpu": 32, "cuda": 256}
_SETTING = re.compile(r"^(auto|cpu|cuda(:(\d+))?)$")
GIB = 2**30
MIB = 2**20


class DeviceUnavailableError(ConfigError):
    """`engine.device` names a device this process cannot see."""


def resolve_device(setting: str) -> torch.device:
    """`auto` is the first CUDA device when one is visible, else the CPU; `cuda[:N]` must be visible."""
    match = _SETTING.match(setting)
    if match is None:
        raise ConfigError(f"engine.device {setting!r} is not one of auto, cpu, cuda, cuda:N")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"engine.device={setting}, but no CUDA device is visible to this process "
            "(torch.cuda.is_available() is False); set engine.device: cpu or auto"
        )
    index = int(match.group(3) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailableError(
            f"engine.device={setting}, but this process sees {count} CUDA device(s) (0..{count - 1}); "
            "check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


def cuda_compute_dtype(bf16_supported: bool) -> torch.dtype:
    """Weights, activations and the KV cache on a GPU: bf16, or fp16 on a device without bf16."""
    return torch.bfloat16 if bf16_supported else torch.float16


def default_batched_tokens(device: torch.device, configured: int | None) -> int:
    return configured if configured is not None else DEFAULT_BATCHED_TOKENS[device.type]


def default_batch_size_limit(device: torch.device, configured: int | None) -> int:
    return configured if configured is not None else DEFAULT_BATCH_SIZE_LIMIT[device.type]


def check_shared_device(shares: Mapping[str, float], device: str = "the GPU") -> None:
    """Roles placed on one device: their `engine.gpu_memory_utilization` must sum to at most 0.95."""
    total = sum(shares.values())
    if total > MAX_SHARED_UTILIZATION + 1e-9:
        parts = " + ".join(f"{name} {share:.2f}" for name, share in shares.items())
        raise ConfigError(
            f"the workers sharing {device} ask for {parts} = {total:.2f} of its memory "
            f"(engine.gpu_memory_utilization); together they may take at most {MAX_SHARED_UTILIZATION}"
        )


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as one engine sees it once its weights are loaded and its warm-up step has run."""

    total_bytes: int
    # what this engine may still place (KV cache, decode graphs): free on the device plus what this
    # process's allocator caches unused, less the room its steps' activations take again
    free_bytes: int
    engine_bytes: int  # what this engine holds: weights, the warm-up's activation peak, CUDA state it loaded


def check_weights_fit(weight_bytes: int, total_bytes: int, free_bytes: int, utilization: float) -> None:
    """Refuse, before anything is placed, weights larger than the engine's share or the free memory
    (MemoryReading.available_bytes: the allocator's cache counts as free)."""
    share = int(total_bytes * utilization)
    if weight_bytes > share:
        raise CapacityError(
            f"the weights take {weight_bytes / GIB:.2f} GiB, more than this engine's share of the device: "
            f"engine.gpu_memory_utilization={utilization} of {total_bytes / GIB:.2f} GiB is "
            f"{share / GIB:.2f} GiB; raise it, or serve the model on a larger device"
        )
    if weight_bytes > free_bytes:
        raise CapacityError(
            f"the weights take {weight_bytes / GIB:.2f} GiB, but only {free_bytes / GIB:.2f} GiB of the "
            "device is free (another process holds the rest)"
        )


def plan_device_blocks(
    bytes_per_block: int,
    block_size: int,
    memory: DeviceMemory,
    utilization: float,
    max_model_len: int,
    graph_bytes: int = 0,
) -> int:
    """KV blocks within the engine's share of the device, after the weights, the warm-up's peak and the
    decode graphs captured later (`graph_bytes`, cuda_graphs.estimate_graph_bytes); refuses, with
    figures, what cannot fit in the share or in what is free."""
    share = int(memory.total_bytes * utilization)
    kv_bytes = share - memory.engine_bytes - graph_bytes
    min_blocks = -(-max_model_len // block_size)
    need = min_blocks * bytes_per_block
    graphs = f" and {graph_bytes / GIB:.2f} GiB is kept for decode graphs" if graph_bytes else ""
    if kv_bytes < need:
        raise CapacityError(
            f"engine.gpu_memory_utilization={utilization} gives this engine {share / GIB:.2f} GiB of the "
            f"device's {memory.total_bytes / GIB:.2f} GiB; weights and warm-up take "
            f"{memory.engine_bytes / GIB:.2f} GiB{graphs}, which leaves "
            f"{max(kv_bytes, 0) / MIB:.0f} MiB for KV, "
            f"but one sequence of max_model_len={max_model_len} needs {need / MIB:.0f} MiB; raise "
            "engine.gpu_memory_utilization or lower engine.max_model_len"
        )
    if kv_bytes + graph_bytes > memory.free_bytes:
        others = memory.total_bytes - memory.free_bytes - memory.engine_bytes
        raise CapacityError(
            f"engine.gpu_memory_utilization={utilization} plans {kv_bytes / GIB:.2f} GiB of KV{graphs}, "
            f"but only {memory.free_bytes / GIB:.2f} GiB of the device is free: another process holds "
            f"{max(others, 0) / GIB:.2f} GiB, or engines built earlier in this one do; lower "
            "engine.gpu_memory_utilization"
        )
    return kv_bytes // bytes_per_block


class MemoryProbe(Protocol):
    """A device's memory figures as this process sees them: the seam between the KV plan and torch.cuda
    (CudaMemoryProbe). Tests plan over a simulated device with a caching allocator behind it."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device; free leaves out what any caching allocator holds."""
        ...

    def memory_allocated(self) -> int:
        """Bytes in this process's live tensors on the device."""
        ...

    def memory_reserved(self) -> int:
        """Bytes this process's caching allocator holds from the device: its live tensors and its cache."""
        ...

    def max_memory_allocated(self) -> int:
        """The most memory_allocated has been since reset_peak."""
        ...

    def reset_peak(self) -> None:
        """Starts max_memory_allocated over from memory_allocated now."""
        ...


@dataclass(frozen=True)
class CudaMemoryProbe:
    """torch.cuda's figures for one device."""

    device: torch.device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass(frozen=True)
class MemoryReading:
    """One reading of a MemoryProbe."""

    free_bytes: int  # free on the device
    total_bytes: int
    allocated_bytes: int  # this process's live tensors
    reserved_bytes: int  # this process's allocator: live tensors and its cache

    @property
    def available_bytes(self) -> int:
        """What this process can still place: the device's free memory and its allocator's unused cache."""
        return self.free_bytes + self.reserved_bytes - self.allocated_bytes


def read_memory(probe: MemoryProbe) -> MemoryReading:
    free, total = probe.mem_get_info()
    return MemoryReading(free, total, probe.memory_allocated(), probe.memory_reserved())


def measure_device_memory(
    probe: MemoryProbe,
    warm_up: Callable[[], int],
    weight_bytes: int,
    before_load: MemoryReading | None = None,
) -> DeviceMemory:
    """The figures for plan_device_blocks: runs `warm_up` (one full step; it returns the bytes of scratch
    KV it held, which the KV cache replaces) between readings, its activations being the allocator's peak
    over the live bytes before it. `before_load`: the reading taken before the weights were placed (context
    created), when there is one; else accounting starts at the warm-up."""
    before = read_memory(probe)
    probe.reset_peak()
    scratch_bytes = warm_up()
    peak = probe.max_memory_allocated()
    after = read_memory(probe)
    activation_bytes = max(0, peak - before.allocated_bytes - scratch_bytes)
    return account_engine_memory(before_load or before, after, weight_bytes, activation_bytes)


def account_engine_memory(
    start: MemoryReading, now: MemoryReading, weight_bytes: int, activation_bytes: int
) -> DeviceMemory:
    """What one engine holds, from a reading at its start and one after its warm-up, and what is free to it.

    It holds its weights (`weight_bytes`, or the live bytes added since `start` where more: buffers), its
    steps' activation peak, and what the device lost since `start` beyond the allocator's reservations:
    the CUDA modules and library state its build loaded, which a process loads once, so the first engine
    pays them. Other engines' tensors and the allocator's cache are not its: the cache, and the device's
    free memory, are free to it less its activations.
    """
    held = max(weight_bytes, now.allocated_bytes - start.allocated_bytes)
    outside = (start.free_bytes - now.free_bytes) - (now.reserved_bytes - start.reserved_bytes)
    return DeviceMemory(
        total_bytes=now.total_bytes,
        free_bytes=max(0, now.available_bytes - activation_bytes),
        engine_bytes=held + activation_bytes + max(0, outside),
    )
