"""What the CPU can do, read from /proc/cpuinfo. Decisions are made at run time, never hard-coded."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags of the first CPU, e.g. {"avx2", "fma", "avx512_bf16"}; empty where unknown."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return frozenset()
    return frozenset()


def has_native_bf16_matmul(flags: frozenset[str]) -> bool:
    """True where bf16 matrix multiplies run in hardware (AVX512-BF16 or AMX), not emulated."""
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def can_run_cpu_kernels(flags: frozenset[str]) -> bool:
    """The C kernels in kernels.c need AVX2, FMA and F16C (the fp16 scales of GGUF blocks): every x86 CPU
    with AVX2 and FMA has F16C too."""
    return {"avx2", "fma", "f16c"} <= flags
