"""Loading a prepared model directory: manifest check, config, safetensors weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from services.common.errors import CorruptModelError, ModelNotFoundError
from services.common.manifest import Manifest, load_verified_manifest
from services.engine.models.config import ModelConfig
from services.engine.models.registry import CausalLM, build_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    manifest: Manifest
    weight_bytes: int


def load_model(model_dir: str | Path, dtype: str) -> LoadedModel:
    """Verify the directory against its manifest, then build the model. Nothing loads from a hub."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    manifest = load_verified_manifest(path, scope="model")
    config = ModelConfig.from_dir(path)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
    torch_dtype = DTYPES[dtype]
    model = build_model(config, weights, torch_dtype)
    elem = torch.empty((), dtype=torch_dtype).element_size()
    weight_bytes = sum(t.numel() for t in weights.values()) * elem
    log.info(
        "model loaded",
        extra={"model_fingerprint": manifest.model_fingerprint, "dtype": dtype, "weight_bytes": weight_bytes},
    )
    return LoadedModel(model, config, manifest, weight_bytes)
