"""Sizing and allocating the paged KV cache tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import CapacityError
from services.engine.model_config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.block_size * elem

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)


def plan_num_blocks(spec: KVCacheSpec, kv_cache_memory_mb: int, max_model_len: int) -> int:
    """Blocks that fit the budget. Refuses when not even one full-length sequence would fit."""
    num_blocks = kv_cache_memory_mb * 1024 * 1024 // spec.bytes_per_block
    min_blocks = -(-max_model_len // spec.block_size)
    if num_blocks < min_blocks:
        need_mb = -(-min_blocks * spec.bytes_per_block // (1024 * 1024))
        raise CapacityError(
            f"engine.kv_cache_memory_mb={kv_cache_memory_mb} holds {num_blocks} blocks of "
            f"{spec.block_size} tokens, but one sequence of max_model_len={max_model_len} needs "
            f"{min_blocks} ({need_mb} MB); raise engine.kv_cache_memory_mb or lower engine.max_model_len"
        )
    return num_blocks


def check_host_memory(weight_bytes: int, kv_bytes: int) -> None:
    """Refuse to start when weights plus the KV cache exceed the memory available to this process: the
    host's MemAvailable, or less where a memory cgroup (a container's limit) leaves less."""
    available = _mem_available_bytes()
    if available is not None and weight_bytes + kv_bytes > available:
        raise CapacityError(
            f"weights ({weight_bytes / 2**20:.0f} MB) plus KV cache ({kv_bytes / 2**20:.0f} MB) exceed "
            f"the {available / 2**20:.0f} MB of memory available; lower engine.kv_cache_memory_mb"
        )


def fits_host_memory(num_bytes: int) -> bool:
    """Whether `num_bytes` more fit the memory the host has available (True where that is unknown)."""
    available = _mem_available_bytes()
    return available is None or num_bytes <= available


def _mem_available_bytes() -> int | None:
    """The host's MemAvailable, capped by the memory cgroup's headroom; None where neither is known."""
    known = [n for n in (_meminfo_available_bytes(), cgroup_headroom_bytes()) if n is not None]
    return min(known) if known else None


def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage) files: cgroup v2, then v1's memory controller, as a container sees its own cgroup
CGROUP_MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
)
NO_LIMIT = 2**62  # v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_headroom_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """What the memory cgroup this process sees at `root` still allows (limit minus usage), or None where
    there is no limit or no cgroup file to read (/proc/meminfo shows the host's memory even in a
    container, so a pod's limit would otherwise go unseen)."""
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= NO_LIMIT:
            return None
        return max(0, int(limit_text) - usage)
    return None


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One tensor per layer: [num_blocks * block_size, 2, num_kv_heads, head_dim]."""
    shape = (num_blocks * spec.block_size, 2, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
