"""Where `model.weights: gguf-hybrid` switches from the GGUF blocks to the unpacked GEMM: the largest step,
in tokens, that still runs the C kernels over the blocks (`LlamaModel.small_step_max_tokens`).

The number comes from a table shipped beside this module (step_thresholds.json), keyed by the CPU's class
(what its instruction sets make fast: `cpu_class`) and the engine's thread count, and filled by `kvrelay
bench threshold` on each CPU it was measured on. It is never calibrated at load: replicas and restarts
on one kind of machine agree on it, and so on which path computed each step's tokens.
`engine.small_step_max_tokens` overrides it. A CPU class the table lacks takes the nearest one measured
(`FALLBACK`), and a thread count between two entries the entry below it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError

TABLE = Path(__file__).with_name("step_thresholds.json")
# CPU classes, most capable first: the first whose flag the CPU has is its class. The GEMM side is fast
# where bf16 runs in hardware (AMX, AVX512-BF16); the block side gains from 512-bit and 256-bit VNNI.
CLASS_FLAGS = (
    ("amx", "amx_bf16"),
    ("avx512_bf16", "avx512_bf16"),
    ("avx512_vnni", "avx512_vnni"),
    ("avx_vnni", "avx_vnni"),
    ("avx2", "avx2"),
)
# Where a class has no entry: the classes to try next, in order.
FALLBACK = {
    "amx": ("avx512_bf16", "avx512_vnni", "avx_vnni", "avx2"),
    "avx512_bf16": ("amx", "avx512_vnni", "avx_vnni", "avx2"),
    "avx512_vnni": ("avx_vnni", "avx2", "avx512_bf16", "amx"),
    "avx_vnni": ("avx2", "avx512_vnni", "avx512_bf16", "amx"),
    "avx2": ("avx_vnni", "avx512_vnni", "avx512_bf16", "amx"),
}
SETTING = "engine.small_step_max_tokens"


@dataclass(frozen=True)
class StepThreshold:
    """A threshold and where it came from (printed at start, shown by the worker's info)."""

    max_tokens: int
    source: str


def cpu_class(flags: frozenset[str]) -> str:
    """The table's key for a CPU with these /proc/cpuinfo flags (one that runs the kernels has avx2)."""
    return next((name for name, flag in CLASS_FLAGS if flag in flags), "avx2")


def load_table(path: Path = TABLE) -> list[dict[str, Any]]:
    """The table's entries: each has `cpu`, `threads` and `small_step_max_tokens`."""
    document = json.loads(path.read_text())
    entries = document["entries"]
    for entry in entries:
        if entry["cpu"] not in FALLBACK or entry["threads"] < 1 or entry["small_step_max_tokens"] < 1:
            raise ValueError(f"{path}: an entry with an unknown CPU class or a count below 1: {entry}")
    return entries


def lookup(entries: Sequence[Mapping[str, Any]], flags: frozenset[str], num_threads: int) -> StepThreshold:
    """The threshold for this CPU at `num_threads`: its class's entry with the most threads up to
    `num_threads` (else its fewest), or the nearest class's (FALLBACK)."""
    wanted = cpu_class(flags)
    for name in (wanted, *FALLBACK[wanted]):
        rows = [entry for entry in entries if entry["cpu"] == name]
        if not rows:
            continue
        below = [entry for entry in rows if entry["threads"] <= num_threads]
        entry = max(below, key=_threads) if below else min(rows, key=_threads)
        measured = entry.get("measured_on", "unknown CPU")
        borrowed = "" if name == wanted else f" (this CPU is {wanted}; the table has no entry for it)"
        source = f"table: {name}, {entry['threads']} threads, measured on {measured}{borrowed}"
        return StepThreshold(int(entry["small_step_max_tokens"]), source)
    raise ConfigError(f"the step threshold table has no entries: set {SETTING}")


def resolve(setting: int | None, flags: frozenset[str], num_threads: int) -> StepThreshold:
    """`engine.small_step_max_tokens` when set (at least 1), else the shipped table's entry."""
    if setting is not None:
        if setting < 1:
            raise ConfigError(f"{SETTING} must be at least 1, got {setting}")
        return StepThreshold(setting, SETTING)
    return lookup(load_table(), flags, num_threads)


def _threads(entry: Mapping[str, Any]) -> int:
    return int(entry["threads"])
