"""The model's shape, read from a Hugging Face `config.json`. No torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import CorruptModelError, ModelLoadError, ModelNotFoundError
from services.engine.models.rope_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    RopeScaling,
    layer_rope,
)


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
    # How full-attention layers stretch RoPE (None: plain RoPE); models/rope_config.py reads it.
    rope_scaling: RopeScaling | None = None
    # Per layer: the sliding window (None: full attention), the RoPE base and scaling. Empty: full attention,
    # `rope_theta` and `rope_scaling` everywhere. Gemma 3 interleaves local layers (window, local base,
    # no scaling) with global ones (full context, global base, linear scaling on the larger checkpoints).
    layer_windows: tuple[int | None, ...] = ()
    layer_rope_thetas: tuple[float, ...] = ()
    layer_rope_scalings: tuple[RopeScaling | None, ...] = ()
    raw: dict[str, Any] | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_rope_theta(self, layer: int) -> float:
        return self.layer_rope_thetas[layer] if self.layer_rope_thetas else self.rope_theta

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        return self.layer_rope_scalings[layer] if self.layer_rope_scalings else self.rope_scaling

    @property
    def has_sliding_windows(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def kv_window(self) -> int | None:
        """How far back any layer still reads: the widest window when every layer has one, else None
        (a global layer reads the whole context, so no KV can ever be dropped)."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

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
            num_layers = int(raw["num_hidden_layers"])
            layer_types = _layer_types(raw, num_layers)
            ropes = {t: layer_rope(raw, t) for t in (FULL_ATTENTION, *layer_types)}  # (base, scaling)
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            return cls(
                architecture=str(architectures[0]),
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=ropes[FULL_ATTENTION][0],
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_tuple(raw.get("eos_token_id")),
                layer_windows=tuple(
                    int(window) if t == SLIDING_ATTENTION and window else None for t in layer_types
                ),
                rope_scaling=ropes[FULL_ATTENTION][1],
                layer_rope_thetas=tuple(ropes[t][0] for t in layer_types),
                layer_rope_scalings=tuple(ropes[t][1] for t in layer_types),
                raw=raw,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


def _layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention kind, from `layer_types` or the older ways configs said it."""
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
        if pattern and raw.get("sliding_window"):  # Gemma 3: every pattern-th layer is global
            is_global = [(i + 1) % int(pattern) == 0 for i in range(num_layers)]
            types = [FULL_ATTENTION if g else SLIDING_ATTENTION for g in is_global]
        elif raw.get("use_sliding_window") and raw.get("sliding_window"):  # Qwen: from max_window_layers on
            first = int(raw.get("max_window_layers", 0))
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
        else:
            types = [FULL_ATTENTION] * num_layers
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        known = f"{FULL_ATTENTION}/{SLIDING_ATTENTION}"
        raise ModelLoadError(f"layer_types {types!r} is not {num_layers} of {known}")
    return [str(t) for t in types]


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)
