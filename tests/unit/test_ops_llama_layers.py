"""The kernel path of LlamaModel (every layer in one C call) against its torch path, step by step, on tiny
random Llamas: same logits and same KV cache for prefill, prefix and mixed decode steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.model_config import ModelConfig
from services.engine.models.llama import LlamaModel
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from tests.tiny_model import make_tiny_llama

BLOCK_SIZE = 4
NUM_BLOCKS = 48

SHAPES: dict[str, dict[str, Any]] = {
    "gqa-64": {},  # hidden 64, 4 heads / 2 kv heads, head_dim 16
    "odd-blocks-40": {  # hidden 40 and intermediate 88: K % 16 == 8 takes the tail path
        "hidden_size": 40,
        "intermediate_size": 88,
        "num_attention_heads": 5,
        "num_key_value_heads": 1,
    },
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA, which the C kernels need")
    assert load_cpu_kernels() is not None  # a build error raises KernelBuildError here
    return make_tiny_llama(tmp_path_factory.mktemp(request.param), **SHAPES[request.param])


def build(path: Path, weight_dtype: torch.dtype, use_kernels: bool) -> LlamaModel:
    weights = {k: v.to(weight_dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
    model = LlamaModel(ModelConfig.from_dir(path), weights, torch.float32, use_cpu_kernels=use_kernels)
    assert (model.kernels is not None) == use_kernels
    return model


def caches(model: LlamaModel, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    cfg = model.config
    shape = (NUM_BLOCKS * BLOCK_SIZE, 2, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]


def steps() -> list[tuple[list[RowSpec], list[RowSpec]]]:
    """(decode rows, prefill rows) per step, over shuffled block ids: fresh prompts, then decode mixed
    with a prefix chunk and a new prompt."""
    a, b, c = [17, 3, 40, 8], [5, 33, 21], [11, 29, 2, 44]
    return [
        ([], [RowSpec(a, 0, 7), RowSpec(b, 0, 5)]),
        ([RowSpec(a, 7, 1), RowSpec(b, 5, 1)], [RowSpec(c, 0, 6)]),
        ([RowSpec(a, 8, 1)], [RowSpec(b, 6, 4), RowSpec(c, 6, 3)]),
        ([RowSpec(a, 9, 1), RowSpec(b, 10, 1), RowSpec(c, 9, 1)], []),
    ]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_matches_torch_path(tiny: Path, weight_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Also over fp16 caches (engine.kv_cache_dtype float16): the C kernels write and read them as the
    torch path's write_kv and gathers do, so the caches agree to an fp16 rounding at most."""
    fast, slow = build(tiny, weight_dtype, True), build(tiny, weight_dtype, False)
    fast_caches, slow_caches = caches(fast, kv_dtype), caches(slow, kv_dtype)
    vocab = fast.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for decode, prefill in steps():
        meta = build_metadata(decode, prefill, BLOCK_SIZE)
        assert meta.num_tokens <= fast.small_step_max_tokens
        token_ids = torch.randint(0, vocab, (meta.num_tokens,), generator=g)  # [num_tokens]
        logits_indices = torch.arange(meta.num_tokens)  # [num_tokens]: every token's logits
        got = fast.forward(token_ids, fast_caches, meta, logits_indices)
        want = slow.forward(token_ids, slow_caches, meta, logits_indices)
        # fp16: a k or v element whose fp32 value the two paths round differently lands one fp16 ulp apart
        logits_tol = 1e-4 if kv_dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=logits_tol, rtol=logits_tol)
    tol = 1e-5 if kv_dtype == torch.float32 else 1e-3
    for got_cache, want_cache in zip(fast_caches, slow_caches, strict=True):
        assert got_cache.dtype == kv_dtype
        torch.testing.assert_close(got_cache, want_cache, atol=tol, rtol=tol)


def test_large_steps_take_the_torch_path(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(tiny, torch.bfloat16, True)
    reference = build(tiny, torch.bfloat16, False)
    model.small_step_max_tokens = 4

    def refuse(*args: object) -> None:
        raise AssertionError("a 9-token step went to the kernel path")

    monkeypatch.setattr(model, "_kernel_forward", refuse)
    meta = build_metadata([], [RowSpec([0, 1, 2], 0, 9)], BLOCK_SIZE)
    token_ids = torch.arange(9)  # [9]
    last = torch.tensor([8])  # [1]
    got = model.forward(token_ids, caches(model), meta, last)
    want = reference.forward(token_ids, caches(reference), meta, last)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
