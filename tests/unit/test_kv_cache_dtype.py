"""engine.kv_cache_dtype resolved for a built model (loader.resolve_kv_dtype), on stand-in models at the
seam: the auto choice per path, the refusals, and the fingerprint a non-default cache serves under."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError

from services.common.config import EngineConfig
from services.common.errors import ConfigError
from services.engine.loading.loader import kv_fingerprint, resolve_kv_dtype


@dataclass
class _Paged:
    name: str


@dataclass
class _Model:
    kv_dtype: torch.dtype
    paged: _Paged
    attention_kernels: object | None = None


ON_KERNELS = _Model(torch.float32, _Paged("torch"), attention_kernels=object())


def test_auto_takes_fp16_only_for_int8_activations_on_the_cpu_kernels() -> None:
    assert resolve_kv_dtype("auto", ON_KERNELS, int8_activations=True) == torch.float16
    assert resolve_kv_dtype("auto", ON_KERNELS, int8_activations=False) == torch.float32  # gguf, safetensors
    on_gpu = _Model(torch.bfloat16, _Paged("triton"))
    assert resolve_kv_dtype("auto", on_gpu, int8_activations=False) == torch.bfloat16


def test_a_named_dtype_is_honoured_on_torch_attention() -> None:
    assert resolve_kv_dtype("float16", ON_KERNELS, int8_activations=False) == torch.float16
    assert resolve_kv_dtype("float32", ON_KERNELS, int8_activations=True) == torch.float32
    torch_bf16 = _Model(torch.bfloat16, _Paged("torch"))
    assert resolve_kv_dtype("float32", torch_bf16, int8_activations=False) == torch.float32


def test_triton_keeps_its_own_cache_dtype_and_says_so() -> None:
    triton = _Model(torch.bfloat16, _Paged("triton"))
    with pytest.raises(ConfigError, match=r"kv_cache_dtype float16 needs torch attention.*bfloat16"):
        resolve_kv_dtype("float16", triton, int8_activations=False)
    same = _Model(torch.float32, _Paged("triton"))
    assert resolve_kv_dtype("float32", same, int8_activations=False) == torch.float32  # nothing to change


def test_unknown_names_are_refused_by_the_schema_and_the_resolver() -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="not one of auto, float32, float16"):
        resolve_kv_dtype("int8", ON_KERNELS, int8_activations=False)


def test_the_fingerprint_depends_on_the_cache_dtype() -> None:
    base = "ab" * 32
    assert kv_fingerprint(base, torch.float16) != kv_fingerprint(base, torch.float32) != base
    assert kv_fingerprint(base, torch.float16) == kv_fingerprint(base, torch.float16)
