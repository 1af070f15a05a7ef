"""The KV a prefill replica ships to a decode replica, and the error for KV that does not fit.

A module of its own so the KV transfer layer can carry KV without importing the engine core; it also names
dtypes as the KV wire and the configs spell them (dtype_name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidRequestError


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the KV wire, configs, manifests and logs name it: "float16" for torch.float16."""
    return str(dtype).removeprefix("torch.")


# The KV dtypes by those names: what a peer's KV layout or a stored segment may say.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVExport:
    """The KV of prompt positions start_token.. of one request, every layer, and an encoder-decoder
    request's encoder output: what a prefill replica ships."""

    start_token: int
    kv: torch.Tensor  # [num_layers, num_tokens, 2, num_kv_heads, head_dim], on the engine's device
    # An encoder-decoder request's encoder output [num_source_tokens, d_model]: the decode replica builds
    # the cross-attention KV from it (docs/encoder-decoder.md). None for a decoder-only model.
    encoder_states: torch.Tensor | None = None


class KVTransferError(InvalidRequestError):
    """Received KV that does not fit the reservation it is meant for (wrong start or token count)."""
