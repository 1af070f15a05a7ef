"""Typed wrappers over the C kernels in kernels.c. Tensors are fp32 on the CPU, last dim contiguous; a KV
cache is fp32 or fp16 (engine.kv_cache_dtype).

The kernels write into the `out` tensors they are given, so a caller can keep buffers across steps.
Each method's torch twin is in reference.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.engine.ops.quant import INT8_ACTIVATIONS, QuantizedWeight, WeightFormat

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_F = ctypes.c_float


class LlamaDims(ctypes.Structure):
    """kr_dims in kernels.c: one Llama model's shape, weight format and rotary tables."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("weights_format", ctypes.c_int32),  # quant.WeightFormat
        ("kv_f16", ctypes.c_int32),  # the caches hold fp16 (else fp32)
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
    ]


class LlamaLayerPointers(ctypes.Structure):
    """kr_layer in kernels.c: where one decoder layer's weights and KV cache live."""

    _fields_ = [
        ("qkv_proj", ctypes.c_void_p),
        ("o_proj", ctypes.c_void_p),
        ("gate_up_proj", ctypes.c_void_p),
        ("down_proj", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
    ]


_DIMS = ctypes.POINTER(LlamaDims)
_LAYERS = ctypes.POINTER(LlamaLayerPointers)

_SIGNATURES: dict[str, list[type]] = {
    "kr_llama_work_floats": [_DIMS, _I],
    "kr_llama_layers": [_DIMS, _LAYERS, _I, _P, _I, _P, _P, _P, _I, _P, _P, _C],
    "kr_rms_norm": [_P, _I, _P, _P, _I, _I, _I, _F],
    "kr_linear": [_P, _I, _P, _C, _P, _I, _I, _I, _I, _C, _P, _C],
    "kr_dequantize": [_P, _C, _P, _I, _I, _C, _C],
    "kr_silu_mul": [_P, _I, _P, _I, _I, _I, _C],
    "kr_rope_write_kv": [_P, _I, _I, _C, _C, _C, _P, _P, _P, _P, _P, _C],
    "kr_paged_attention": [_P, _I, _P, _I, _I, _C, _C, _C, _P, _P, _I, _P, _P, _I, _I, _F, _C, _C],
}


def _rows(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
    """Row stride of a 2-D tensor whose rows are contiguous; raises on any other layout."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(
            f"expected a row-contiguous 2-D {dtype} CPU tensor, got {x.dtype} {tuple(x.stride())}"
        )
    return x.stride(0)


def _format_of(weight: torch.Tensor | QuantizedWeight) -> tuple[WeightFormat, int, int]:
    """The weight's format and shape [N, K]; raises for a layout the kernels cannot read."""
    if isinstance(weight, QuantizedWeight):
        _flat(weight.data, torch.uint8)
        return weight.format, *weight.shape
    num_out, k = weight.shape
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous() or k % 8:
        raise ValueError(f"weight must be contiguous fp32/bf16 with K % 8 == 0, got {weight.dtype} {k}")
    return (WeightFormat.BF16 if weight.dtype == torch.bfloat16 else WeightFormat.F32), num_out, k


def kv_f16(kv_dtype: torch.dtype) -> int:
    """The kernels' kv_f16 flag for a cache of `kv_dtype`: 1 for fp16, 0 for fp32; raises for any other."""
    if kv_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the kernels read fp32 or fp16 KV caches, not {kv_dtype}")
    return int(kv_dtype == torch.float16)


def _kv_f16(cache: torch.Tensor) -> int:
    """kv_f16 of a cache the kernels can read in place (contiguous, on the CPU)."""
    flag = kv_f16(cache.dtype)
    _flat(cache, cache.dtype)
    return flag


def _flat(x: torch.Tensor, dtype: torch.dtype) -> None:
    if not x.is_contiguous() or x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"expected a contiguous {dtype} CPU tensor, got {x.dtype}")


class CpuKernels:
    """The AVX2 kernels. All shapes in the comments are the caller's; M is the number of tokens."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        # The built library's name (kernels-<digest of source, compiler and options>): one build, one set of
        # bits; engine.deterministic puts it in the model fingerprint.
        self.build_id = Path(library._name).stem
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(library, name)
            fn.argtypes = argtypes
            fn.restype = None
        library.kr_llama_work_floats.restype = ctypes.c_int64
        library.kr_llama_layers.restype = ctypes.c_int
        library.kr_paged_attention.restype = ctypes.c_int

    def llama_layers(
        self,
        dims: LlamaDims,
        layers: ctypes.Array[LlamaLayerPointers],
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        token_rows: torch.Tensor,
    ) -> None:
        """Run every decoder layer on the residual stream h [M, hidden] in place (kr_llama_layers).

        positions, slot_mapping, token_rows: [M]; block_tables [num_rows, max_blocks]. The layers' weights
        and caches are the ones `layers` points at.
        """
        _flat(h, torch.float32)
        for t in (positions, slot_mapping, block_tables, token_rows):
            _flat(t, torch.int64)
        num_tokens = h.shape[0]
        work = torch.empty(self._lib.kr_llama_work_floats(dims, num_tokens))  # [floats]
        failed = self._lib.kr_llama_layers(
            dims, layers, len(layers), h.data_ptr(), num_tokens, positions.data_ptr(),
            slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], token_rows.data_ptr(),
            work.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("kr_llama_layers could not allocate attention's buffers")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
        """out [M, K] = RMSNorm(x [M, K]) * weight [K]."""
        _flat(weight, torch.float32)
        ldx, ldo = _rows(x), _rows(out)
        self._lib.kr_rms_norm(
            x.data_ptr(), ldx, weight.data_ptr(), out.data_ptr(), ldo, x.shape[0], x.shape[1], eps
        )

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | QuantizedWeight,
        out: torch.Tensor,
        accumulate: bool = False,
        *,
        int8_activations: bool = False,
    ) -> None:
        """out [M, N] = x [M, K] @ weight [N, K].T, or out += that. weight is fp32 or bf16 with K % 8 == 0,
        or a QuantizedWeight (Q8_0, Q4_1), whose product may take x quantized to int8 per 32-block."""
        weight_format, num_out, k = _format_of(weight)
        code = int(weight_format) | (INT8_ACTIVATIONS if int8_activations else 0)
        if x.shape[1] != k or out.shape != (x.shape[0], num_out):
            raise ValueError(
                f"shape mismatch: x {tuple(x.shape)}, weight {(num_out, k)}, out {tuple(out.shape)}"
            )
        data = weight.data if isinstance(weight, QuantizedWeight) else weight
        needs_scratch = weight_format != WeightFormat.F32
        xbuf = torch.empty(x.shape[0] * k if needs_scratch else 0)  # [M * K] bf16 layout or block sums
        self._lib.kr_linear(
            x.data_ptr(), _rows(x), data.data_ptr(), code, out.data_ptr(), _rows(out),
            x.shape[0], num_out, k, int(accumulate), xbuf.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def dequantize(
        self, weight: QuantizedWeight, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The weight as fp32 or bf16 [N, K] (into `out` when given; bf16 rounded to nearest even)."""
        num_out, k = weight.shape
        out = torch.empty(num_out, k, dtype=dtype) if out is None else out  # [N, K]
        if out.shape != (num_out, k):
            raise ValueError(f"out {tuple(out.shape)} does not match the weight {(num_out, k)}")
        if out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"weights unpack to float32 or bfloat16, not {out.dtype}")
        _flat(out, out.dtype)
        self._lib.kr_dequantize(
            weight.data.data_ptr(), int(weight.format), out.data_ptr(), num_out, k,
            int(out.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, I] = silu(gate_up[:, :I]) * gate_up[:, I:], gate_up [M, 2 * I]."""
        inter = out.shape[1]
        if gate_up.shape != (out.shape[0], 2 * inter):
            raise ValueError(f"gate_up {tuple(gate_up.shape)} does not match out {tuple(out.shape)}")
        ldg, ldo = _rows(gate_up), _rows(out)
        self._lib.kr_silu_mul(
            gate_up.data_ptr(), ldg, out.data_ptr(), ldo, out.shape[0], inter, torch.get_num_threads()
        )

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Rotate q and k inside qkv [M, (num_heads + 2 * kv_heads) * head_dim] in place, then write k and v
        into cache [num_slots, 2, kv_heads, head_dim] (fp32, or fp16 rounded to nearest even) at
        slot_mapping [M]. cos, sin: [max_positions, hd]."""
        cos, sin = cos_sin
        head_dim = cache.shape[-1]
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or cos.shape[1] != head_dim:
            raise ValueError("qkv, cache and the rotary tables disagree on head sizes")
        for t in (cos, sin):
            _flat(t, torch.float32)
        for t in (positions, slot_mapping):
            _flat(t, torch.int64)
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
        self._lib.kr_rope_write_kv(
            qkv.data_ptr(), _rows(qkv), qkv.shape[0], num_heads, num_kv_heads, head_dim,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), slot_mapping.data_ptr(),
            _kv_f16(cache),
        )  # fmt: skip

    def paged_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        token_rows: torch.Tensor,
        positions: torch.Tensor,
        block_size: int,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> None:
        """Causal attention of each token over keys 0..position of its own sequence, read from the cache;
        with a `window`, over its last `window` keys only. `scale` defaults to head_dim ** -0.5.

        q, out: [M, num_heads * head_dim]; cache [num_slots, 2, kv_heads, head_dim], fp32 or fp16;
        block_tables [num_rows, max_blocks]; token_rows, positions: [M].
        """
        _, _, num_kv_heads, head_dim = cache.shape
        num_heads = q.shape[1] // head_dim
        if out.shape != q.shape or head_dim % 8:
            raise ValueError("the attention output does not match the query, or head_dim % 8 != 0")
        kv_f16 = _kv_f16(cache)
        for t in (block_tables, token_rows, positions):
            _flat(t, torch.int64)
        failed = self._lib.kr_paged_attention(
            q.data_ptr(), _rows(q), out.data_ptr(), _rows(out), q.shape[0], num_heads, num_kv_heads,
            head_dim, cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], token_rows.data_ptr(),
            positions.data_ptr(), window or 0, block_size, head_dim**-0.5 if scale is None else scale,
            torch.get_num_threads(), kv_f16,
        )  # fmt: skip
        if failed:
            raise MemoryError("kr_paged_attention could not allocate its buffers")
