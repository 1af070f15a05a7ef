"""The dispatch table: which kernel specialization serves a layer, chosen once per model at load.

A key is what a layer's attention depends on: (dtype, head size, GQA ratio, sliding window or not, KV
block size). A specialization is what the kernels are compiled for: the constexprs (dtype, HEAD_DIM,
BLOCK_SIZE, BLOCK_M, the dot precision) and the launch shape (warps, stages). The GQA ratio and the
window are runtime arguments (the ratio's power-of-two padding decides how many query tokens share a
BLOCK_M tile), so 288 keys map onto 18 specializations, and every one of them is compiled ahead of time
for sm_90 in CI (tests/unit/test_triton_dispatch.py). A key outside the table (another head size, a ratio
above 8, an odd block size) has no entry: the model keeps the torch-native attention.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from services.engine.model_config import ModelConfig

HEAD_SIZES = (64, 128, 256)
BLOCK_SIZES = (16, 32)
GQA_RATIOS = tuple(range(1, 9))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Query rows per tile: GQA heads packed with the tokens that share them. 16 is tl.dot's smallest M.
BLOCK_M = 16
# Split-KV decode: segments per row, and when to use it (few rows, so the 2-D grid leaves SMs idle).
NUM_SEGMENTS = 16
SPLIT_MAX_PROGRAMS = 128  # decode rows x KV heads up to this (an H200 has 132 SMs)
SPLIT_MIN_BLOCKS = 2 * NUM_SEGMENTS  # ...and a context of at least this many blocks


@dataclass(frozen=True)
class SpecKey:
    dtype: torch.dtype
    head_size: int
    gqa_ratio: int
    sliding: bool
    block_size: int


@dataclass(frozen=True)
class KernelSpec:
    """One compiled specialization of the attention kernels (and of the store and reduce kernels)."""

    dtype: torch.dtype
    head_dim: int
    block_size: int
    block_m: int = BLOCK_M
    num_warps: int = 4
    num_stages: int = 2

    @property
    def precision(self) -> str:
        """tl.dot's input precision: exact fp32 products for fp32 (the tests' oracle dtype)."""
        return "ieee" if self.dtype == torch.float32 else "tf32"

    @property
    def triton_dtype(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]


def _spec_for(key: SpecKey) -> KernelSpec:
    warps = 8 if key.head_size == 256 else 4
    return KernelSpec(key.dtype, key.head_size, key.block_size, num_warps=warps)


DISPATCH_TABLE: dict[SpecKey, KernelSpec] = {
    key: _spec_for(key)
    for key in (
        SpecKey(dtype, head, ratio, sliding, block)
        for dtype, head, ratio, sliding, block in itertools.product(
            DTYPES, HEAD_SIZES, GQA_RATIOS, (False, True), BLOCK_SIZES
        )
    )
}


def specializations() -> list[KernelSpec]:
    """Every distinct specialization the table holds, in a stable order."""
    return sorted(set(DISPATCH_TABLE.values()), key=lambda s: (str(s.dtype), s.head_dim, s.block_size))


def layer_keys(config: ModelConfig, dtype: torch.dtype, block_size: int) -> list[SpecKey]:
    """The key of each layer of a model: its attention's dtype, head size, GQA ratio, window, block size."""
    ratio = config.num_heads // config.num_kv_heads if config.num_heads % config.num_kv_heads == 0 else 0
    return [
        SpecKey(dtype, config.head_dim, ratio, config.window(i) is not None, block_size)
        for i in range(config.num_layers)
    ]


def model_specs(config: ModelConfig, dtype: torch.dtype, block_size: int) -> list[KernelSpec] | None:
    """Each layer's specialization, or None when any layer has no entry (the model stays on torch)."""
    specs = [DISPATCH_TABLE.get(key) for key in layer_keys(config, dtype, block_size)]
    if any(spec is None for spec in specs):
        return None
    return [spec for spec in specs if spec is not None]


def group_pad(gqa_ratio: int) -> int:
    """The GQA ratio rounded up to a power of two: query heads per KV head in a tile."""
    return 1 << (gqa_ratio - 1).bit_length()
