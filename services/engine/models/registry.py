"""Model families by the architecture name in config.json."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from services.common.errors import ModelLoadError
from services.engine.layers.attention_backend import PagedAttention, choose_attention
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.model_config import ModelConfig
from services.engine.models.gemma3 import Gemma3Model
from services.engine.models.llama import LlamaModel
from services.engine.models.qwen import Qwen2Model, Qwen3Model
from services.engine.models.t5_paged import T5ForEngine


class CausalLM(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's dtype (may be wider than the compute dtype)
    device: torch.device  # where the weights are, and so the KV cache and the step's work
    paged: PagedAttention  # what its layers store and attend with (attention_backend.py)

    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


# One file per family: models/llama.py, models/qwen.py (Llama with options), models/gemma3.py, models/t5.py.
_FAMILIES: dict[str, type] = {
    "LlamaForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": Qwen2Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "Gemma3ForCausalLM": Gemma3Model,
    "T5ForConditionalGeneration": T5ForEngine,  # encoder-decoder: models/t5.py, models/t5_paged.py
}


def check_architecture(architecture: str) -> None:
    """A ModelLoadError naming `architecture` and the known ones, unless a family serves it."""
    if architecture not in _FAMILIES:
        known = ", ".join(sorted(_FAMILIES))
        raise ModelLoadError(f"architecture {architecture!r} is not supported (known: {known})")


def build_model(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    attention: str = "auto",
    block_size: int = 16,
    int8_activations: bool = False,
    unpacked_dtype: torch.dtype | None = None,
    small_step_max_tokens: int | None = None,
) -> CausalLM:
    """The family's model over `weights` (on their device), its layers on the paged attention `attention`
    names for KV blocks of `block_size` (attention_backend.py). The C kernels run only under `auto`.
    `int8_activations`, `unpacked_dtype` and `small_step_max_tokens` are the Llama-family options of the
    same names (models/llama.py); a family without them refuses them."""
    check_architecture(config.architecture)
    family = _FAMILIES[config.architecture]
    tensors = [w for w in weights.values() if isinstance(w, torch.Tensor)]  # GGUF blocks live on the CPU
    device = tensors[0].device if tensors else torch.device("cpu")
    paged = choose_attention(attention, config, dtype, device, block_size)
    cpu_kernels = attention == "auto" and paged.name == "torch"
    given = {
        "int8_activations": int8_activations or None,
        "unpacked_dtype": unpacked_dtype,
        "small_step_max_tokens": small_step_max_tokens,
    }
    options = {name: value for name, value in given.items() if value is not None}
    if options and not issubclass(family, LlamaModel):
        raise ModelLoadError(f"{config.architecture} has no C kernel path: {', '.join(options)} do not apply")
    model: CausalLM = family(config, weights, dtype, use_cpu_kernels=cpu_kernels, paged=paged, **options)
    return model
