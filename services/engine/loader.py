"""Loading a model: from a prepared directory (manifest check, config, safetensors weights) or from a state
dict already in memory (a GPU check builds its model on the device); dtype resolution for both."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from services.common.errors import ConfigError, CorruptModelError, ModelNotFoundError
from services.common.manifest import UNKNOWN_FINGERPRINT, Manifest, load_verified_manifest
from services.engine.models.config import ModelConfig
from services.engine.models.registry import CausalLM, build_model
from services.engine.ops.cpu_features import cpu_flags, has_native_bf16_matmul

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """How weights are stored and in which dtype activations, the KV cache and sums are computed."""

    weights: torch.dtype
    compute: torch.dtype

    def describe(self) -> str:
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if self.weights == self.compute:
            return names[self.weights]
        return f"{names[self.weights]} weights, {names[self.compute]} compute"


def resolve_precision(dtype: str, device: str = "cpu", flags: frozenset[str] | None = None) -> Precision:
    """`model.dtype` to a precision. "auto" takes bf16 throughout where bf16 math runs in hardware (CUDA,
    AVX512-BF16 or AMX CPUs), and bf16 weights with fp32 compute elsewhere: on an AVX2-only CPU bf16
    matmuls are emulated and slow, while fp32 math over bf16 weights reads as few bytes per decode step.
    """
    if dtype in DTYPES:
        return Precision(DTYPES[dtype], DTYPES[dtype])
    if dtype != "auto":
        raise ConfigError(f"model.dtype {dtype!r} is not one of auto, float32, bfloat16")
    if device == "cuda":  # bf16 throughout; fp16 on a GPU without bf16 (before Ampere)
        no_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported()
        half = torch.float16 if no_bf16 else torch.bfloat16
        return Precision(half, half)
    native = has_native_bf16_matmul(cpu_flags() if flags is None else flags)
    return Precision(torch.bfloat16, torch.bfloat16 if native else torch.float32)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    manifest: Manifest
    weight_bytes: int
    precision: Precision | None = None


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: torch.device | None = None,
    *,
    attention: str = "auto",
    block_size: int = 16,
) -> LoadedModel:
    """Verify the directory against its manifest, then build the model on `device` (the CPU by default),
    its layers on the paged attention `engine.attention` names (attention_backend.py) for KV blocks of
    `block_size`. Nothing loads from a hub."""
    device = device or torch.device("cpu")
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    manifest = load_verified_manifest(path, scope="model")
    config = ModelConfig.from_dir(path)
    precision = resolve_precision(dtype, device.type)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            loaded = load_file(str(file), device=str(device))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
        weights.update({name: t.to(precision.weights) for name, t in loaded.items()})
        del loaded
    return _build(config, weights, manifest, precision, dtype, attention, block_size)


def stored_weight_bytes(model_dir: str | Path, dtype: str, device: str = "cuda") -> int:
    """The bytes the weights of a prepared directory will take once loaded in `dtype` on `device`, read
    from the safetensors headers alone (nothing is loaded), so a device too small refuses before it runs."""
    elem = torch.empty((), dtype=resolve_precision(dtype, device).weights).element_size()
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    total += math.prod(f.get_slice(name).get_shape()) * elem
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
    return total


def load_state_dict(
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    dtype: str = "auto",
    fingerprint: str | None = None,
    *,
    attention: str = "auto",
    block_size: int = 16,
) -> LoadedModel:
    """A model from a transformers-style config dict and state dict in memory, without a disk round trip.

    The tensors keep their device. A state dict has no files for a manifest to pin, so the model
    fingerprint (prefix-cache hashes, P/D pairing) is `fingerprint` when given, else a digest of the
    config and of every tensor's name, shape and dtype: two different random models of one shape share it,
    so pass a fingerprint wherever replicas built this way must not pair.
    """
    model_config = ModelConfig.from_dict(dict(config))
    device = next(iter(state_dict.values())).device.type if state_dict else "cpu"
    precision = resolve_precision(dtype, device)
    weights = {name: t.to(precision.weights) for name, t in state_dict.items()}
    manifest = Manifest(
        files={},
        tokenizer_fingerprint=UNKNOWN_FINGERPRINT,
        model_fingerprint=fingerprint or _state_dict_digest(config, state_dict),
        source={"kind": "state_dict"},
    )
    return _build(model_config, weights, manifest, precision, dtype, attention, block_size)


def _state_dict_digest(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(dict(config), sort_keys=True, default=str).encode())
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    return digest.hexdigest()


def _build(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    manifest: Manifest,
    precision: Precision,
    dtype: str,
    attention: str = "auto",
    block_size: int = 16,
) -> LoadedModel:
    model = build_model(config, weights, precision.compute, attention=attention, block_size=block_size)
    elem = torch.empty((), dtype=precision.weights).element_size()
    weight_bytes = getattr(model, "weight_bytes", sum(t.numel() for t in weights.values()) * elem)
    log.info(
        "model loaded",
        extra={
            "model_fingerprint": manifest.model_fingerprint,
            "dtype": dtype,
            "precision": precision.describe(),
            "weight_bytes": weight_bytes,
        },
    )
    return LoadedModel(model, config, manifest, weight_bytes, precision)
