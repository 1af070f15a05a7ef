"""Model families by the architecture name in config.json."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from services.common.errors import ModelLoadError
from services.engine.attention import AttentionMetadata
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaModel


class CausalLM(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's dtype (may be wider than the compute dtype)

    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


_FAMILIES: dict[str, type] = {
    "LlamaForCausalLM": LlamaModel,
}


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> CausalLM:
    family = _FAMILIES.get(config.architecture)
    if family is None:
        known = ", ".join(sorted(_FAMILIES))
        raise ModelLoadError(f"architecture {config.architecture!r} is not supported (known: {known})")
    model: CausalLM = family(config, weights, dtype)
    return model
