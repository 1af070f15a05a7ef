"""The Qwen family: Qwen2/Qwen2.5 and Qwen3, as options of the Llama model (models/llama.py).

Both are Llama's decoder (RMSNorm, GQA attention with RoPE, SiLU-gated MLP) with one change each:

- Qwen2 adds biases to the q, k and v projections (not to o). The architecture fixes them, so its
  config.json has no `attention_bias` key. Llama's C kernels take those biases, so Qwen2 keeps the
  fused fp32 kernel path.
- Qwen3 has no biases (unless `attention_bias` says so) but normalizes every head of q and of k with
  an RMSNorm over head_dim (`q_norm`, `k_norm`) before RoPE, and its head_dim may differ from
  hidden / heads. The fused kernel does not do those norms, so Qwen3 runs the torch layer, with the
  family-neutral C kernel for decode attention.

Sliding-window layers (`use_sliding_window`, from `max_window_layers` on) come with the config's
`layer_windows` and are handled by the Llama model for both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from services.common.errors import ModelLoadError
from services.engine.model_config import ModelConfig
from services.engine.models.llama import LlamaModel
from services.engine.ops.fused_layers import LlamaLayer
from services.engine.ops.quant import Weight


class Qwen2Model(LlamaModel):
    def __init__(
        self, config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, **options: Any
    ) -> None:
        super().__init__(dataclasses.replace(config, attention_bias=True), weights, dtype, **options)


class Qwen3Model(LlamaModel):
    def __init__(
        self, config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, **options: Any
    ) -> None:
        if config.attention_bias:  # Qwen3's attention_bias also puts a bias on o_proj, which Llama lacks
            raise ModelLoadError("Qwen3 with attention_bias=true is not supported")
        super().__init__(config, weights, dtype, **options)

    def _load_layer(
        self, take: Callable[[str], Weight], take_tensor: Callable[[str], torch.Tensor], i: int
    ) -> LlamaLayer:
        cfg = self.config
        p = f"model.layers.{i}.self_attn."
        q_norm = take_tensor(p + "q_norm.weight").expand(cfg.num_heads, -1)  # [num_heads, head_dim]
        k_norm = take_tensor(p + "k_norm.weight").expand(cfg.num_kv_heads, -1)  # [num_kv_heads, head_dim]
        qk_norm = torch.cat([q_norm, k_norm])  # [num_heads + num_kv_heads, head_dim], one row per head
        return dataclasses.replace(super()._load_layer(take, take_tensor, i), qk_norm=qk_norm)
