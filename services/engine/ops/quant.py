"""Weights kept in the GGUF block formats Q8_0 and Q4_1, as stored: no dequantization at load.

A `QuantizedWeight` is a [N, K] matrix whose rows are runs of 32-weight blocks in ggml's layout (the
bytes of a GGUF tensor, used as they are; kernels.c documents the two layouts). The C kernels multiply
by it directly (`CpuKernels.linear`) and unpack it to fp32 for large prefill batches
(`CpuKernels.dequantize`). The torch code here is the reference the tests hold the kernels to, and the
quantizer that turns random or dequantized weights into blocks for tests and random-weight models; it
rounds as ggml's reference quantizers do (Q8_0: d = max|w| / 127; Q4_1: d = (max - min) / 15, m = min),
so a block quantized here holds what llama.cpp's would (up to Q8_0's ties: torch rounds half to even).

Rows are independent, so row operations (the Q/K row order GGUF converters apply, concatenating q, k
and v into one projection) work on the stored bytes. At model load each row's bytes are then regrouped
field by field (`split`: all scales, then all minimums, then all values; the same bytes, nothing
dequantized), the layout the kernels read fastest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block in both formats


class WeightFormat(IntEnum):
    """How a weight matrix is stored; the values are kernels.c's kr_format."""

    F32 = 0
    BF16 = 1
    Q8_0 = 2
    Q4_1 = 3
    Q4_1_SPLIT = 4  # Q4_1's blocks with each row regrouped: its scales, its minimums, its nibbles (split)
    Q8_0_SPLIT = 5  # Q8_0's blocks with each row regrouped: its scales, its values (split)


INT8_ACTIVATIONS = 16  # kernels.c KR_INT8_ACTIVATIONS: or-ed into a block format's code
BLOCK_BYTES = {
    WeightFormat.Q8_0: 2 + BLOCK,
    WeightFormat.Q4_1: 2 + 2 + BLOCK // 2,
    WeightFormat.Q4_1_SPLIT: 2 + 2 + BLOCK // 2,
    WeightFormat.Q8_0_SPLIT: 2 + BLOCK,
}
SPLIT = {WeightFormat.Q4_1: WeightFormat.Q4_1_SPLIT, WeightFormat.Q8_0: WeightFormat.Q8_0_SPLIT}
_FIELDS = {WeightFormat.Q4_1: (2, 2, BLOCK // 2), WeightFormat.Q8_0: (2, BLOCK)}  # a block's fields, bytes
# GGUF's tensor type IDs (ggml's GGMLQuantizationType) for the formats kept quantized.
GGML_TYPES = {8: WeightFormat.Q8_0, 3: WeightFormat.Q4_1}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in a block format: `data` uint8 [N, K // 32 * block bytes], rows contiguous."""

    data: torch.Tensor
    format: WeightFormat
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        num_rows, num_cols = self.shape
        if self.format not in BLOCK_BYTES or num_cols % BLOCK:
            raise ValueError(f"{self.format!r} needs a block format and K % {BLOCK} == 0, got K={num_cols}")
        expected = (num_rows, num_cols // BLOCK * BLOCK_BYTES[self.format])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(
                f"block data must be uint8 {expected}, got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, order: torch.Tensor | Sequence[int]) -> QuantizedWeight:
        """The rows in `order` (a permutation or a selection)."""
        index = torch.as_tensor(order, dtype=torch.long)
        return QuantizedWeight(self.data[index].contiguous(), self.format, (len(index), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [N, K] (the reference for kr_dequantize)."""
        num_rows, num_cols = self.shape
        if self.format in SPLIT.values():
            return _join(self).dequantize()
        blocks = self.data.view(num_rows, num_cols // BLOCK, BLOCK_BYTES[self.format])
        scale = _fp16(blocks[..., 0:2])  # [N, num_blocks, 1]
        if self.format == WeightFormat.Q8_0:
            q = blocks[..., 2:].view(torch.int8).float()  # [N, num_blocks, 32]
            return (scale * q).reshape(num_rows, num_cols)
        minimum = _fp16(blocks[..., 2:4])  # [N, num_blocks, 1]
        packed = blocks[..., 4:]  # [N, num_blocks, 16]
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # [N, num_blocks, 32]
        return (scale * q + minimum).reshape(num_rows, num_cols)


Weight = torch.Tensor | QuantizedWeight  # a matrix as stored: a float tensor, or GGUF blocks


def cat_rows(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Row-wise concatenation of weights of one format and one K (q, k and v into one projection)."""
    first = weights[0]
    if any(w.format != first.format or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("only weights of one format and one number of columns concatenate")
    data = torch.cat([w.data for w in weights])
    return QuantizedWeight(data, first.format, (data.shape[0], first.shape[1]))


def can_split(weight: QuantizedWeight) -> bool:
    """Whether `split` regroups `weight`: Q8_0, or Q4_1 with an even number of blocks per row."""
    if weight.format == WeightFormat.Q4_1:
        return weight.shape[1] // BLOCK % 2 == 0
    return weight.format == WeightFormat.Q8_0


def split(weight: QuantizedWeight) -> QuantizedWeight:
    """The rows regrouped field by field (kernels.c Q4_1S, Q8_0S): Q4_1 as [scales][minimums][nibbles],
    Q8_0 as [scales][values]. The same blocks and bytes, laid out so the int8 kernels convert eight blocks'
    scales at once and read a row's values back to back (Q4_1: two blocks' nibbles in one load)."""
    if not can_split(weight):
        raise ValueError(
            f"only Q8_0, and Q4_1 with an even number of blocks per row, split: {weight.format!r}"
        )
    num_rows, num_cols = weight.shape
    blocks = weight.data.view(num_rows, num_cols // BLOCK, BLOCK_BYTES[weight.format])
    parts, offset = [], 0
    for size in _FIELDS[weight.format]:
        parts.append(blocks[..., offset : offset + size].reshape(num_rows, -1))  # [N, num_blocks * size]
        offset += size
    return QuantizedWeight(torch.cat(parts, dim=1).contiguous(), SPLIT[weight.format], weight.shape)


def _join(weight: QuantizedWeight) -> QuantizedWeight:
    """`split` undone: ggml's blocks."""
    stored = next(plain for plain, split_format in SPLIT.items() if split_format == weight.format)
    num_rows, num_cols = weight.shape
    num_blocks = num_cols // BLOCK
    fields, offset = [], 0
    for size in _FIELDS[stored]:
        part = weight.data[:, offset * num_blocks : (offset + size) * num_blocks]
        fields.append(part.reshape(num_rows, num_blocks, size))
        offset += size
    data = torch.cat(fields, dim=-1).reshape(num_rows, -1)
    return QuantizedWeight(data.contiguous(), stored, weight.shape)


def quantize(weight: torch.Tensor, weight_format: WeightFormat) -> QuantizedWeight:
    """fp32 [N, K] to blocks, rounding as ggml's reference quantizers do."""
    num_rows, num_cols = weight.shape
    if num_cols % BLOCK:
        raise ValueError(f"K={num_cols} is not a multiple of {BLOCK}")
    w = weight.detach().float().reshape(num_rows, num_cols // BLOCK, BLOCK)  # [N, num_blocks, 32]
    if weight_format == WeightFormat.Q8_0:
        amax = w.abs().amax(dim=-1, keepdim=True)  # [N, num_blocks, 1]
        scale = amax / 127
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(w * inverse).to(torch.int8)  # [N, num_blocks, 32]
        parts = [_fp16_bytes(scale), q.view(torch.uint8)]
    elif weight_format == WeightFormat.Q4_1:
        low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)  # [N, num_blocks, 1]
        scale = (high - low) / 15
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.clamp(torch.floor((w - low) * inverse + 0.5), 0, 15).to(torch.uint8)  # [N, nb, 32]
        packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # [N, num_blocks, 16]
        parts = [_fp16_bytes(scale), _fp16_bytes(low), packed]
    else:
        raise ValueError(f"{weight_format!r} is not a block format")
    data = torch.cat(parts, dim=-1).reshape(num_rows, -1).contiguous()
    return QuantizedWeight(data, weight_format, (num_rows, num_cols))


def int8_activations_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ weight.T with x quantized to int8 as the kernels do (one scale d = max|x| / 127 per 4
    activations, round half away from zero), in float64: the reference for kr_linear's int8 activations."""
    num_rows, num_cols = x.shape
    xb = x.double().reshape(num_rows, num_cols // 4, 4)  # [M, groups, 4]
    scale = (xb.abs().amax(-1, keepdim=True).float() / 127).double()  # [M, groups, 1], fp32 as in C
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = (xb * inverse).float().double()
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # [M, groups, 4]
    return F.linear((q * scale).reshape(num_rows, num_cols), weight.dequantize().double()).float()


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 [..., 2] uint8 as fp32 [..., 1]."""
    return two_bytes.contiguous().view(torch.float16).float()


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 1] as little-endian fp16 [..., 2] uint8."""
    return values.to(torch.float16).contiguous().view(torch.uint8)
