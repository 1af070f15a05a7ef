"""Loading a prepared model directory: manifest check, config, safetensors weights, dtype resolution."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from services.common.errors import ConfigError, CorruptModelError, ModelNotFoundError
from services.common.manifest import Manifest, load_verified_manifest
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
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
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
    native = device == "cuda" or has_native_bf16_matmul(cpu_flags() if flags is None else flags)
    return Precision(torch.bfloat16, torch.bfloat16 if native else torch.float32)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    manifest: Manifest
    weight_bytes: int
    precision: Precision | None = None


def load_model(model_dir: str | Path, dtype: str) -> LoadedModel:
    """Verify the directory against its manifest, then build the model. Nothing loads from a hub."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    manifest = load_verified_manifest(path, scope="model")
    config = ModelConfig.from_dir(path)
    precision = resolve_precision(dtype)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            loaded = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
        weights.update({name: t.to(precision.weights) for name, t in loaded.items()})
        del loaded
    model = build_model(config, weights, precision.compute)
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
