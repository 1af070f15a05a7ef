"""The model's shape, read from a Hugging Face `config.json`. No torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import CorruptModelError, ModelLoadError, ModelNotFoundError


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.exists():
            raise ModelNotFoundError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
        config = cls.from_dict(raw)
        generation = model_dir / "generation_config.json"
        if generation.exists():
            try:
                extra = _as_tuple(json.loads(generation.read_text()).get("eos_token_id"))
            except (OSError, json.JSONDecodeError, TypeError, ValueError) as exc:
                raise CorruptModelError(f"{generation} is not valid: {exc}") from exc
            merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architecture (`architectures` is empty)")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            return cls(
                architecture=str(architectures[0]),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_tuple(raw.get("eos_token_id")),
                raw=raw,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported yet")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
