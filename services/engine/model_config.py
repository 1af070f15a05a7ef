"""The model's shape, read from a Hugging Face `config.json`. No torch.

Each kind of layer's RoPE settings (`layer_rope`) come from the same file; configs say them three ways,
all read here:

- `rope_theta` beside `rope_scaling` ({"type" or "rope_type": ..., "factor": ...}), the transformers 4.x
  spelling that Llama 3.x and Qwen2.5/Qwen3 checkpoints ship with;
- transformers v5's `rope_parameters`, one dict that also holds `rope_theta`;
- `rope_parameters` keyed by layer type ("full_attention", "sliding_attention"), as Gemma 3 writes it.

Gemma 3's `rope_scaling` stretches its global (full-attention) layers only, as transformers reads it; in
every other family it applies to every layer. Served: `default`, `linear` (Gemma 3's global layers),
`llama3` (Llama 3.1 to 3.3) and `yarn` (Qwen2.5, Qwen3). Any other type (dynamic, longrope, ...) is
refused with a ModelLoadError that names it. The frequencies themselves are computed in engine/layers/rope.py.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
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
    # How full-attention layers stretch RoPE (None: plain RoPE); layer_rope below reads it.
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

    @property
    def is_encoder_decoder(self) -> bool:
        """An encoder reads the request's input once; the engine's sequences are the decoder's."""
        return self.architecture in ENCODER_DECODER_ARCHITECTURES

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architecture (`architectures` is empty)")
        if str(architectures[0]) in ENCODER_DECODER_ARCHITECTURES:
            return _encoder_decoder(raw, str(architectures[0]))
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


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class RopeType(enum.StrEnum):
    LINEAR = "linear"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclass(frozen=True)
class RopeScaling:
    """How a layer's RoPE is stretched past its pretraining length; None stands for plain RoPE. Each
    field is read only by the types named beside it, and every default is already filled in."""

    rope_type: RopeType
    factor: float
    original_max_position_embeddings: int = 0  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends outwards to whole dimensions
    attention_factor: float = 1.0  # yarn's mscale: multiplies cos and sin (1.0 for the others)


def layer_rope(raw: dict[str, Any], layer_type: str) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling (None: plain RoPE) of one kind of layer."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = raw.get("rope_scaling") or {}
    if _is_gemma3(raw) and layer_type != FULL_ATTENTION:
        scaling = {}
    merged = {**params, **scaling}
    rope_type = _type_of(scaling) or _type_of(params) or "default"
    return _theta(raw, merged, layer_type), _scaling(raw, merged, str(rope_type))


def _is_gemma3(raw: dict[str, Any]) -> bool:
    architectures = raw.get("architectures") or [""]
    return raw.get("model_type") in ("gemma3", "gemma3_text") or str(architectures[0]).startswith("Gemma3")


def _type_of(params: dict[str, Any]) -> Any:
    return params.get("rope_type") or params.get("type")


def _theta(raw: dict[str, Any], params: dict[str, Any], layer_type: str) -> float:
    if params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    if layer_type == SLIDING_ATTENTION and "rope_local_base_freq" in raw:  # older Gemma 3 configs
        return float(raw["rope_local_base_freq"])
    return float(raw.get("rope_theta", 10000.0))


def _scaling(raw: dict[str, Any], params: dict[str, Any], rope_type: str) -> RopeScaling | None:
    """`params` as a RopeScaling, with transformers' defaults for what the config leaves out."""
    if rope_type == "default":
        return None
    if rope_type not in {t.value for t in RopeType}:
        served = ", ".join(["default", *(t.value for t in RopeType)])
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (served: {served})")
    kind = RopeType(rope_type)
    if kind == RopeType.LINEAR:
        return RopeScaling(kind, float(params["factor"]))
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings", 2048)
    )
    if kind == RopeType.LLAMA3:
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        return RopeScaling(
            kind, float(params["factor"]), original, low_freq_factor=low, high_freq_factor=high
        )
    factor = params.get("factor")  # DeepSeek-style yarn configs may leave it to the two lengths
    factor = float(factor) if factor is not None else int(raw["max_position_embeddings"]) / original
    return RopeScaling(
        kind,
        factor,
        original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_yarn_attention_factor(params, factor),
    )


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """The config's `attention_factor`, else 0.1 * ln(factor) + 1, or the ratio of two such terms
    weighted by `mscale` and `mscale_all_dim` when both are set (DeepSeek's way)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
    if weight and weight_all:
        return mscale(float(weight)) / mscale(float(weight_all))
    return mscale(1.0)


# Encoder-decoder families: what the engine's paged cache and scheduler see is the decoder (issue 51).
ENCODER_DECODER_ARCHITECTURES = ("T5ForConditionalGeneration",)
DEFAULT_T5_POSITIONS = 512  # n_positions: T5's positions are relative; the length it was trained for


def _encoder_decoder(raw: dict[str, Any], architecture: str) -> ModelConfig:
    """The decoder's shape as the engine sees it (layers, heads, KV head size: its cache), from a T5
    config.json; max_position_embeddings bounds both the source and the decoder sequence."""
    try:
        num_heads = int(raw["num_heads"])
        num_layers = int(raw["num_layers"])
        start = raw.get("decoder_start_token_id", raw.get("pad_token_id", 0))
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["d_model"]),
            intermediate_size=int(raw["d_ff"]),
            num_layers=int(raw.get("num_decoder_layers") or num_layers),
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=int(raw["d_kv"]),
            rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-6)),
            rope_theta=0.0,
            max_position_embeddings=int(raw.get("n_positions") or DEFAULT_T5_POSITIONS),
            tie_word_embeddings=raw.get("tie_word_embeddings") is not False,
            bos_token_id=int(start),
            eos_token_ids=_as_tuple(raw.get("eos_token_id", 1)),
            raw=raw,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc
