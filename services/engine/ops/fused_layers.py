"""The C kernels' view of a Llama-shaped model (`kr_llama_layers`: every layer of a small step in one
call): the layer's weights as the kernels read them, the streamed matrices packed into one huge-page
buffer, and the pointer array into those weights and one set of KV caches, rebuilt only when the caches
change. The models (models/llama.py, qwen.py) hold their layers in `LlamaLayer`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from services.engine.ops import arena
from services.engine.ops.block_linear import format_of, to_dtype, weight_data
from services.engine.ops.cpu import LlamaLayerPointers
from services.engine.ops.quant import QuantizedWeight, Weight, WeightFormat, can_split, split

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: Weight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    o_proj: Weight  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight  # [hidden, intermediate]
    qk_norm: torch.Tensor | None = None  # [num_heads + num_kv_heads, head_dim]: Qwen3's q/k RMSNorm

    def to(self, dtype: torch.dtype) -> LlamaLayer:
        """The same layer with every tensor in `dtype` (no copy where it already is); GGUF blocks stay."""
        return LlamaLayer(
            input_norm=self.input_norm.to(dtype),
            qkv_proj=to_dtype(self.qkv_proj, dtype),
            qkv_bias=None if self.qkv_bias is None else self.qkv_bias.to(dtype),
            o_proj=to_dtype(self.o_proj, dtype),
            post_norm=self.post_norm.to(dtype),
            gate_up_proj=to_dtype(self.gate_up_proj, dtype),
            down_proj=to_dtype(self.down_proj, dtype),
            qk_norm=None if self.qk_norm is None else self.qk_norm.to(dtype),
        )


@dataclass
class KernelPointers:
    """The C view of the layers for one set of KV caches, and the tensors it points into."""

    caches: list[torch.Tensor]
    layers: ctypes.Array[LlamaLayerPointers]
    keep_alive: list[torch.Tensor]


class FusedLayerPointers:
    """The pointer array `kr_llama_layers` reads, over `stored_layers` and the KV caches last asked for."""

    def __init__(self, stored_layers: list[LlamaLayer]) -> None:
        self.stored_layers = stored_layers
        self._pointers: KernelPointers | None = None

    def for_caches(self, kv_caches: list[torch.Tensor]) -> ctypes.Array[LlamaLayerPointers]:
        """Pointers into the stored weights (norms in fp32) and these caches, rebuilt when caches change."""
        known = self._pointers
        if known is not None and same_tensors(known.caches, kv_caches):
            return known.layers
        for cache in kv_caches:
            if cache.dtype != kv_caches[0].dtype or not cache.is_contiguous():
                raise ValueError("the kernel path needs contiguous KV caches of one dtype")
        array = (LlamaLayerPointers * len(kv_caches))()
        keep_alive: list[torch.Tensor] = []
        for i, (s, cache) in enumerate(zip(self.stored_layers, kv_caches, strict=True)):
            norms = (s.input_norm.float(), s.post_norm.float())  # [hidden] each
            bias = None if s.qkv_bias is None else s.qkv_bias.float()  # [qkv_size]
            keep_alive += [*norms, *([] if bias is None else [bias])]
            qkv, o, gate_up, down = (weight_data(w).data_ptr() for w in projections(s))
            array[i] = LlamaLayerPointers(
                qkv, o, gate_up, down,
                None if bias is None else bias.data_ptr(), norms[0].data_ptr(), norms[1].data_ptr(),
                cache.data_ptr(),
            )  # fmt: skip
        self._pointers = KernelPointers(list(kv_caches), array, keep_alive)
        return array


def pack_streamed_weights(layers: list[LlamaLayer], lm_head: Weight) -> tuple[list[LlamaLayer], Weight]:
    """The matrices every decode step reads, moved into one huge-page buffer (ops/arena.py). GGUF blocks
    and tensors of one dtype pack together; a model that mixes them packs only its tensors. Block rows are
    regrouped for the kernels (quant.split) when every block matrix can be, so that the layers keep one
    format."""
    matrices = [w for layer in layers for w in projections(layer)] + [lm_head]
    quantized = [w for w in matrices if isinstance(w, QuantizedWeight)]
    if all(can_split(w) for w in quantized):
        matrices = [split(w) if isinstance(w, QuantizedWeight) else w for w in matrices]
    data = [weight_data(w) for w in matrices]
    packed = matrices
    if len({t.dtype for t in data}) == 1:
        packed = [_like(w, t) for w, t in zip(matrices, arena.pack(data), strict=True)]
    out = [
        dataclasses.replace(layer, **dict(zip(PROJECTIONS, packed[4 * i : 4 * i + 4], strict=True)))  # type: ignore[arg-type]
        for i, layer in enumerate(layers)
    ]
    return out, packed[-1]


def _like(weight: Weight, data: torch.Tensor) -> Weight:
    """`weight` over new storage `data`."""
    return QuantizedWeight(data, weight.format, weight.shape) if isinstance(weight, QuantizedWeight) else data


def projections(layer: LlamaLayer) -> list[Weight]:
    return [getattr(layer, name) for name in PROJECTIONS]


def one_format(layers: list[LlamaLayer]) -> WeightFormat | None:
    """The one format of every projection; None when they differ (the C kernels take one per model)."""
    formats = {format_of(w) for layer in layers for w in projections(layer)}
    return formats.pop() if len(formats) == 1 else None


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
