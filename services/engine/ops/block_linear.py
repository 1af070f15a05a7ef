"""Matrices kept as GGUF blocks (`QuantizedWeight`, Q8_0 or Q4_1) on the torch path of a model, and the
helpers every weight passes through whether it is blocks or a float tensor.

The torch path multiplies by blocks one of two ways: `BlockLinear` unpacks the matrix into a buffer shared
by every matrix of the model at each call (one unpacks at a time), `UnpackedLinear` unpacks it once at load
(model.weights gguf-hybrid), at the cost of a second copy of the weights. `BlockLinears` makes one or the
other for each matrix of a model. The C kernels read the blocks as stored and need none of this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.errors import ModelLoadError
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import cpu_flags, has_native_bf16_matmul
from services.engine.ops.packed_linear import Linear, make_linear
from services.engine.ops.quant import QuantizedWeight, Weight, WeightFormat, cat_rows


def to_dtype(weight: Weight, dtype: torch.dtype) -> Weight:
    return weight if isinstance(weight, QuantizedWeight) else weight.to(dtype)


def format_of(weight: Weight) -> WeightFormat | None:
    """The kernels' name for how `weight` is stored; None for a dtype they cannot read."""
    if isinstance(weight, QuantizedWeight):
        return weight.format
    return {torch.float32: WeightFormat.F32, torch.bfloat16: WeightFormat.BF16}.get(weight.dtype)


def weight_data(weight: Weight) -> torch.Tensor:
    return weight.data if isinstance(weight, QuantizedWeight) else weight


def cat_weight_rows(weights: list[Weight]) -> Weight:
    """Row-wise concatenation (q, k, v into one projection): of tensors, or of GGUF blocks of one format."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return cat_rows([w for w in weights if isinstance(w, QuantizedWeight)])
    if any(isinstance(w, QuantizedWeight) for w in weights):
        raise ModelLoadError("a fused projection mixes GGUF blocks and float tensors")
    return torch.cat([w for w in weights if isinstance(w, torch.Tensor)]).contiguous()


class BlockLinear:
    """y = x @ w.T (+ bias) for GGUF blocks on the torch path: the matrix unpacked into a buffer shared by
    every matrix of the model (one unpacks at a time), then MKL's fp32 GEMM, or, for a bf16 buffer,
    oneDNN's bf16 GEMM over x rounded to bf16 (fp32 sums and output)."""

    def __init__(
        self, kernels: CpuKernels, weight: QuantizedWeight, bias: torch.Tensor | None, buffer: torch.Tensor
    ) -> None:
        self.kernels, self.weight, self.bias, self.buffer = kernels, weight, bias, buffer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_out, k = self.weight.shape
        unpacked = self.buffer[: num_out * k].view(num_out, k)  # [N, K] fp32 or bf16
        w = self.kernels.dequantize(self.weight, unpacked)
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        y = F.linear(x.to(w.dtype), w).to(x.dtype)  # [M, N]
        return y if self.bias is None else y + self.bias


class UnpackedLinear:
    """y = x @ w.T (+ bias) for GGUF blocks unpacked once at load into `dtype` (gguf-hybrid's large steps):
    oneDNN's GEMM over the prepacked copy, x rounded to `dtype` on the way in, fp32 sums and output; the
    same bits as `BlockLinear` with a buffer of that dtype."""

    def __init__(
        self, kernels: CpuKernels, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        unpacked = kernels.dequantize(weight, dtype=dtype)  # [N, K]
        self.nbytes = unpacked.numel() * unpacked.element_size()
        self.dtype, self.bias = dtype, bias
        self.linear = make_linear(unpacked)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.to(self.dtype)).to(x.dtype)  # [M, N]; no copies where x is in dtype already
        return y if self.bias is None else y + self.bias


class BlockLinears:
    """Makes the torch path's matmuls over a model's GGUF block `matrices`: unpacked once at load into
    `unpacked_dtype` when it is set (their bytes counted in `unpacked_bytes`), else unpacked per call into
    one buffer sized for the largest. With int8 activations on a CPU with bf16 in hardware the buffer is
    bf16: int8 activations already trade exactness for speed, so the large steps take bf16 GEMMs too
    (docs/performance.md, "GGUF blocks")."""

    def __init__(
        self,
        kernels: CpuKernels,
        matrices: list[Weight],
        *,
        unpacked_dtype: torch.dtype | None,
        int8_activations: bool,
    ) -> None:
        self.kernels, self.unpacked_dtype = kernels, unpacked_dtype
        self.unpacked_bytes = 0
        self.buffer: torch.Tensor | None = None
        if unpacked_dtype is None:
            sizes = [w.shape[0] * w.shape[1] for w in matrices if isinstance(w, QuantizedWeight)]
            bf16 = int8_activations and has_native_bf16_matmul(cpu_flags())
            dtype = torch.bfloat16 if bf16 else torch.float32
            self.buffer = torch.empty(max(sizes, default=0), dtype=dtype)  # [largest N * K]

    def __call__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        if self.buffer is not None:
            return BlockLinear(self.kernels, weight, bias, self.buffer)
        assert self.unpacked_dtype is not None  # no buffer: unpacked at load
        linear = UnpackedLinear(self.kernels, weight, bias, self.unpacked_dtype)
        self.unpacked_bytes += linear.nbytes
        return linear
