"""A llama GGUF's weights as stored: Q4_1 and Q8_0 tensors stay in their blocks (ops/quant.py).

The prepared directory's fp32 safetensors are transformers' dequantization of the same GGUF, which costs
4-8x the memory and bandwidth of the blocks. This module reads the blocks themselves under the Hugging Face
names the engine already uses, so the quantized path and the fp32 path serve one model: dequantized, every
tensor loaded here equals the safetensors tensor of the same name bit for bit (tests/unit/test_gguf_weights).

Two things make the GGUF differ from the HF layout, and both are undone here as transformers' GGUF loader
undoes them: the tensor names (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`), and
the row order of Q and K, which llama.cpp's converter permutes for its RoPE (see `_unpermute_order`).
Rows of a block format are independent, so the permutation is undone on the stored bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import CorruptModelError, ModelLoadError
from services.engine.model_config import ModelConfig
from services.engine.ops.quant import GGML_TYPES, QuantizedWeight, Weight

# ggml type IDs this path holds: F32 (0) and F16 (1) as fp32 tensors, Q8_0 (8) and Q4_1 (3) as blocks.
FLOAT_TYPES = {0: np.float32, 1: np.float16}
SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | frozenset(GGML_TYPES)
ARCHITECTURES = ("llama",)
BLOCK_ARCHITECTURES = ("LlamaForCausalLM",)  # the prepared config.json's architecture for those

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _read(gguf_path: str | os.PathLike[str]) -> Any:
    """A GGUFReader over the file (memory-mapped); a file that does not parse is a CorruptModelError."""
    from gguf import GGUFReader

    try:
        return GGUFReader(Path(gguf_path))
    except Exception as exc:  # the reader raises ValueError, IndexError, OSError, ... on bad input
        raise CorruptModelError(
            f"GGUF file {str(gguf_path)!r} does not parse: {type(exc).__name__}: {exc}"
        ) from exc


def keeps_quantized(gguf_path: str | os.PathLike[str]) -> bool:
    """Whether every tensor is F32, F16, Q8_0 or Q4_1: the formats the kernels multiply by as stored.

    A file with any other type (Gemma 3's Q5_0/Q4_K/Q6_K) can only be served dequantized, so a prepared
    directory has no reason to keep it. Reads the tensor table only.
    """
    reader = _read(gguf_path)
    return all(int(tensor.tensor_type) in SUPPORTED_TYPES for tensor in reader.tensors)


def load_gguf_weights(gguf_path: str | os.PathLike[str], config: ModelConfig) -> dict[str, Weight]:
    """The weights of a llama GGUF under Hugging Face names: Q4_1/Q8_0 as QuantizedWeight, F32/F16 as fp32.

    Everything is copied off the memory map into ordinary tensors, so the file can be replaced or deleted
    afterwards. Q and K (weights and biases) come back in HF row order. `lm_head.weight` is present only
    when the file has `output.weight` (else the embeddings are tied). Raises ModelLoadError for another
    architecture, a tensor name this mapping does not know, a tensor type it cannot hold, or a Q/K whose
    rows do not match the config's heads.
    """
    reader = _read(gguf_path)
    architecture = _architecture(reader, gguf_path)
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {str(gguf_path)!r} is a {architecture!r} model; quantized weights are read "
            f"for {', '.join(ARCHITECTURES)} only"
        )
    names = {tensor.name: _hf_name(tensor.name, config) for tensor in reader.tensors}
    unknown = sorted(name for name, hf_name in names.items() if hf_name is None)
    if unknown:
        raise ModelLoadError(f"GGUF file {str(gguf_path)!r} has tensors with no known HF name: {unknown}")
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        hf_name = names[tensor.name]
        assert hf_name is not None
        weight = _copy_tensor(tensor, gguf_path)
        heads = _permuted_heads(hf_name, config)
        if heads is not None:
            weight = _take_rows(weight, _unpermute_order(weight, heads, config.head_dim, hf_name))
        weights[hf_name] = weight
    return weights


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    """The heads llama.cpp permuted `hf_name` over: num_heads for Q, num_kv_heads for K, None for others."""
    if ".self_attn.q_proj." in hf_name:
        return config.num_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_kv_heads
    return None


def _take_rows(weight: Weight, order: torch.Tensor) -> Weight:
    """`weight`'s rows in `order`: rows of blocks moved as stored, or the first dim of a float tensor."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(order)
    return weight[order].contiguous()


def _architecture(reader: Any, gguf_path: str | os.PathLike[str]) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"GGUF file {str(gguf_path)!r} has no general.architecture")
    return str(field.contents())


def _hf_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The HF parameter name of a llama GGUF tensor, or None when it has none (or names a layer past
    the config's last)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
    if part not in LAYER_NAMES or layer >= config.num_layers:
        return None
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"


def _copy_tensor(tensor: Any, gguf_path: str | os.PathLike[str]) -> Weight:
    """One GGUF tensor copied into torch memory: blocks as QuantizedWeight, floats as fp32."""
    ggml_type = int(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first: (K, N) -> (N, K)
    if ggml_type in GGML_TYPES:
        if len(shape) != 2:
            raise ModelLoadError(
                f"{tensor.name} in {str(gguf_path)!r} is a quantized tensor of shape {shape}"
            )
        num_rows, num_cols = shape
        raw = np.array(tensor.data, dtype=np.uint8)  # [N, K // 32 * block bytes], copied off the mmap
        data = torch.from_numpy(raw).reshape(num_rows, -1)
        return QuantizedWeight(data, GGML_TYPES[ggml_type], (num_rows, num_cols))
    if ggml_type in FLOAT_TYPES:
        values = np.array(tensor.data, dtype=FLOAT_TYPES[ggml_type]).astype(np.float32, copy=False)
        return torch.from_numpy(values).reshape(shape)  # [N, K] or [K]
    raise ModelLoadError(
        f"{tensor.name} in {str(gguf_path)!r} is {tensor.tensor_type.name}; quantized weights are read "
        "from F32, F16, Q8_0 and Q4_1 tensors only"
    )


def _unpermute_order(weight: Weight, num_heads: int, head_dim: int, hf_name: str) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation (transformers' `_reverse_permute_weights`).

    HF's rotary embedding pairs dimension i of a head with i + head_dim/2 (rotate_half); llama.cpp's
    pairs 2i with 2i+1. Its converter therefore reorders each head's rows from (half, i) to (i, half):
    GGUF row h*head_dim + 2i + half holds HF row h*head_dim + half*head_dim/2 + i. The order returned
    here, with out[r] = stored[order[r]], takes them back: order[h, half, i] = h*head_dim + 2i + half.
    """
    num_rows = weight.shape[0]
    if num_rows != num_heads * head_dim or head_dim % 2:
        raise ModelLoadError(
            f"{hf_name} has {num_rows} rows; the config's {num_heads} heads of {head_dim} need "
            f"{num_heads * head_dim}"
        )
    stored = torch.arange(num_rows).reshape(num_heads, head_dim // 2, 2)  # [heads, i, half]
    return stored.transpose(1, 2).reshape(num_rows)  # [heads * half * i]
