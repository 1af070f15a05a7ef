"""Where the engine runs: the `engine.device` setting resolved, the dtypes for that device, and the KV plan.

On a CPU the KV cache is sized by `engine.kv_cache_memory_mb` (kv_cache.plan_num_blocks). On a GPU it
takes what is left of the engine's share of the device, `engine.gpu_memory_utilization` of its total
memory, once the weights are in place and a warm-up step has run: the same rule vLLM users know.
Processes that share one device (`kvrelay up` on one GPU, the colocated tests) split the device between
them, and together may ask for at most MAX_SHARED_UTILIZATION of it, so the CUDA context, NCCL and
fragmentation keep room. Every refusal names the figures and the setting to change (exit 78).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.errors import CapacityError, ConfigError

MAX_SHARED_UTILIZATION = 0.95
# A step's token budget when `engine.max_num_batched_tokens` is unset: a 256-token chunk is about a
# second of prefill on a 2-core CPU (under limits.step_timeout_ms); a GPU wants large chunks to fill it.
DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}
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
    """A GPU's memory as the engine sees it once weights are loaded and the warm-up step has run."""

    total_bytes: int
    free_bytes: int  # free on the device now, whoever holds the rest
    engine_bytes: int  # what this engine holds: weights, the warm-up's peak, its CUDA context


def check_weights_fit(weight_bytes: int, total_bytes: int, free_bytes: int, utilization: float) -> None:
    """Refuse, before anything is placed, weights larger than the engine's share or the free memory."""
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
    figures, what cannot fit."""
    share = int(memory.total_bytes * utilization)
    kv_bytes = share - memory.engine_bytes - graph_bytes
    min_blocks = -(-max_model_len // block_size)
    need = min_blocks * bytes_per_block
    if kv_bytes < need:
        graphs = f" and {graph_bytes / GIB:.2f} GiB is kept for decode graphs" if graph_bytes else ""
        raise CapacityError(
            f"engine.gpu_memory_utilization={utilization} gives this engine {share / GIB:.2f} GiB of the "
            f"device's {memory.total_bytes / GIB:.2f} GiB; weights and warm-up take "
            f"{memory.engine_bytes / GIB:.2f} GiB{graphs}, which leaves "
            f"{max(kv_bytes, 0) / MIB:.0f} MiB for KV, "
            f"but one sequence of max_model_len={max_model_len} needs {need / MIB:.0f} MiB; raise "
            "engine.gpu_memory_utilization or lower engine.max_model_len"
        )
    if kv_bytes > memory.free_bytes:
        raise CapacityError(
            f"engine.gpu_memory_utilization={utilization} plans {kv_bytes / GIB:.2f} GiB of KV, but only "
            f"{memory.free_bytes / GIB:.2f} GiB of the device is free: another process holds "
            f"{(memory.total_bytes - memory.free_bytes - memory.engine_bytes) / GIB:.2f} GiB; lower "
            "engine.gpu_memory_utilization"
        )
    return kv_bytes // bytes_per_block


def measure_device_memory(device: torch.device, free_at_start: int) -> DeviceMemory:
    """The figures for plan_device_blocks, after weights and warm-up. `free_at_start` is
    torch.cuda.mem_get_info's free bytes taken before the weights were placed (context created)."""
    free, total = torch.cuda.mem_get_info(device)
    engine = max(free_at_start - free, torch.cuda.memory_reserved(device))
    return DeviceMemory(total_bytes=total, free_bytes=free, engine_bytes=engine)
