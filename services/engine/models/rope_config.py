"""RoPE settings of one kind of layer, read from a Hugging Face `config.json`. No torch.

Configs say it three ways, all read here:

- `rope_theta` beside `rope_scaling` ({"type" or "rope_type": ..., "factor": ...}), the transformers 4.x
  spelling that Llama 3.x and Qwen2.5/Qwen3 checkpoints ship with;
- transformers v5's `rope_parameters`, one dict that also holds `rope_theta`;
- `rope_parameters` keyed by layer type ("full_attention", "sliding_attention"), as Gemma 3 writes it.

Gemma 3's `rope_scaling` stretches its global (full-attention) layers only, as transformers reads it; in
every other family it applies to every layer. Served: `default`, `linear` (Gemma 3's global layers),
`llama3` (Llama 3.1 to 3.3) and `yarn` (Qwen2.5, Qwen3). Any other type (dynamic, longrope, ...) is
refused with a ModelLoadError that names it. The frequencies themselves are computed in engine/rope.py.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from services.common.errors import ModelLoadError

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
