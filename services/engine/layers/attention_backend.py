"""Which paged attention a model's layers run, chosen once per model at load (`engine.attention`).

- `torch`: `write_kv` and `paged_attention` of attention.py (SDPA over gathered blocks), on any device:
  the oracle the Triton kernels are held to, and the fallback.
- `triton`: the kernels of ops/triton (a KV store through the slot mapping, one paged kernel for
  prefill, decode and mixed steps, split-KV decode). On a GPU they are compiled; on the CPU they run
  under Triton's interpreter, slow, for tests and debugging: the process must start with
  TRITON_INTERPRET=1 (it has to precede triton's import, which torch's import does). A layer the
  dispatch table has no entry for is refused at load.
- `auto`: on a CPU, the C kernels where they fit (ops/kernels.c) and torch-native attention otherwise;
  on a GPU, Triton when it is installed, every layer has an entry and the kernels pass a self-check at
  load (a small mixed step and a split-KV decode step against the float64 reference, ops/triton/
  self_check.py), else torch-native (logged).

A process defines the kernels once, compiled or interpreted: a later model wanting the other kind is
refused with the reason, never silently run the wrong way.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch

from services.common.errors import ModelLoadError
from services.engine.layers.attention import DecodeAttention, paged_attention, write_kv
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.model_config import ModelConfig
from services.engine.ops.triton.dispatch import KernelSpec, layer_keys, model_specs

log = logging.getLogger(__name__)

ATTENTION_CHOICES = ("auto", "torch", "triton")


class PagedAttention(Protocol):
    name: str
    graph_safe: bool  # launches read only tensors and the row count: a decode step can be captured

    @property
    def block_size(self) -> int | None:
        """The KV block size it was specialised for; None: any."""
        ...

    def prepare_static(
        self, meta: AttentionMetadata, query_start: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """For a captured decode step over static buffers: take its layout from these tensors
        (query_start [rows + 1], seq_lens [rows], int32) instead of from the host rows."""
        ...

    def store(self, cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k, v [num_tokens, kv_heads, head_dim] through `meta.slot_mapping`."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        decode_attention: DecodeAttention | None = None,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] over the cache (k, v already stored) -> q's shape."""
        ...


class TorchAttention:
    """attention.py's `write_kv` and `paged_attention`, which already have the protocol's signatures."""

    name = "torch"
    graph_safe = False  # the gathers are built from host lists every step
    block_size = None

    def prepare_static(
        self, meta: AttentionMetadata, query_start: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        raise ValueError("torch-native attention cannot be captured in a graph")

    def store(self, cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(cache, meta.slot_mapping, k, v)

    attend = staticmethod(paged_attention)


def choose_attention(
    choice: str, config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int
) -> PagedAttention:
    """The backend `choice` (auto | torch | triton) gives for this model; see the module docstring."""
    if choice not in ATTENTION_CHOICES:
        raise ModelLoadError(f"engine.attention {choice!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "torch" or (choice == "auto" and device.type == "cpu"):
        return TorchAttention()
    specs = model_specs(config, dtype, block_size)
    reason = None
    if specs is None:
        missing = sorted({str(k) for k in layer_keys(config, dtype, block_size)})
        reason = f"no Triton kernel specialization for {', '.join(missing)}"
    elif len(set(specs)) != 1:
        reason = "the layers would need different kernel specializations"
    elif importlib.util.find_spec("triton") is None:
        reason = "triton is not installed"
    if reason is not None:
        if choice == "triton":
            raise ModelLoadError(f"engine.attention: triton: {reason}")
        log.info("Triton attention unavailable, using torch-native attention", extra={"reason": reason})
        return TorchAttention()
    assert specs is not None
    backend = _triton_backend(specs[0], config, device)
    return checked_or_torch(backend, config, device) if choice == "auto" else backend


def checked_or_torch(backend: PagedAttention, config: ModelConfig, device: torch.device) -> PagedAttention:
    """The Triton backend if its kernels agree with the reference on this device, else torch-native
    (logged with the reason): `auto` is never worse than torch-native."""
    from services.engine.layers.triton_self_check import self_check
    from services.engine.ops.triton.launch import TritonAttention

    assert isinstance(backend, TritonAttention)
    windows = [None, *sorted({w for w in config.layer_windows if w is not None})[:1]]
    for window in windows:
        reason = self_check(backend, device, window)
        if reason is not None:
            log.warning(
                "Triton attention failed its self-check; torch-native it is", extra={"reason": reason}
            )
            return TorchAttention()
    return backend


def _triton_backend(spec: KernelSpec, config: ModelConfig, device: torch.device) -> PagedAttention:
    from services.engine.ops.triton import kernels
    from services.engine.ops.triton.launch import TritonAttention

    interpret = device.type == "cpu"
    if interpret and not (kernels.INTERPRETED and kernels.LIBRARY_INTERPRETED):
        raise ModelLoadError(
            "engine.attention: triton on a CPU runs Triton's interpreter, which must be on before torch "
            "loads: start the process with TRITON_INTERPRET=1 (or set engine.attention: torch)"
        )
    if not interpret and kernels.INTERPRETED:
        raise ModelLoadError(
            f"this process runs Triton's interpreter (TRITON_INTERPRET=1): a model on {device} cannot "
            "use compiled kernels; unset it, or set engine.attention: torch"
        )
    return TritonAttention(spec, config.num_heads, config.num_kv_heads)
