"""The C kernels against their torch twins in ops/reference.py, and their batch invariance."""

from __future__ import annotations

import pytest
import torch

from services.engine.layers.rope import RotaryEmbedding
from services.engine.ops import reference
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA, which the C kernels need")
    loaded = load_cpu_kernels()  # a build error raises KernelBuildError here and fails every test
    assert loaded is not None
    return loaded


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("in_features", [64, 72, 576])
def test_linear_matches_reference(
    kernels: CpuKernels, weight_dtype: torch.dtype, num_tokens: int, in_features: int
) -> None:
    x = randn(num_tokens, in_features, seed=1)  # [M, K]
    weight = (randn(37, in_features, seed=2) * 0.1).to(weight_dtype)  # [N, K]
    out = torch.empty(num_tokens, 37)  # [M, N]
    kernels.linear(x, weight, out)
    torch.testing.assert_close(out, reference.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_linear_accumulates_into_out_and_reads_strided_rows(
    kernels: CpuKernels, weight_dtype: torch.dtype
) -> None:
    wide = randn(6, 200, seed=3)  # [M, 200]: x is a column slice with row stride 200
    x = wide[:, 8:136]  # [M, 128]
    weight = (randn(50, 128, seed=4) * 0.1).to(weight_dtype)  # [N, K]
    residual = randn(6, 50, seed=5)  # [M, N]
    out = residual.clone()  # [M, N]
    kernels.linear(x, weight, out, accumulate=True)
    torch.testing.assert_close(out, residual + reference.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_token_the_same_bits_alone_and_in_a_batch(
    kernels: CpuKernels, weight_dtype: torch.dtype
) -> None:
    x = randn(11, 576, seed=6)  # [M, K]
    weight = (randn(300, 576, seed=7) * 0.1).to(weight_dtype)  # [N, K]
    batched = torch.empty(11, 300)  # [M, N]
    kernels.linear(x, weight, batched)
    for i in range(11):
        alone = torch.empty(1, 300)  # [1, N]
        kernels.linear(x[i : i + 1], weight, alone)
        assert torch.equal(alone[0], batched[i]), f"token {i} differs"


def test_linear_refuses_mismatched_shapes(kernels: CpuKernels) -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels.linear(randn(2, 64), randn(8, 64), torch.empty(3, 8))
    with pytest.raises(ValueError, match="K % 8"):
        kernels.linear(randn(2, 12), randn(8, 12), torch.empty(2, 8))


def test_rms_norm_matches_reference(kernels: CpuKernels) -> None:
    x = randn(5, 576, seed=8) * 3  # [M, K]
    weight = randn(576, seed=9)  # [K]
    out = torch.empty(5, 576)  # [M, K]
    kernels.rms_norm(x, weight, out, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_silu_mul_matches_reference(kernels: CpuKernels) -> None:
    gate_up = randn(4, 2 * 100, seed=10) * 4  # [M, 2 * I], I = 100 leaves a scalar tail
    out = torch.empty(4, 100)  # [M, I]
    kernels.silu_mul(gate_up, out)
    torch.testing.assert_close(out, reference.silu_mul(gate_up), atol=1e-5, rtol=1e-5)


def test_rope_write_kv_matches_reference(kernels: CpuKernels) -> None:
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    rope = RotaryEmbedding(head_dim, 128, 10000.0)
    qkv = randn(3, (num_heads + 2 * num_kv_heads) * head_dim, seed=11)  # [M, qkv_size]
    positions = torch.tensor([0, 57, 127])  # [M]
    slots = torch.tensor([9, 2, 5])  # [M]
    cache = torch.zeros(12, 2, num_kv_heads, head_dim)  # [slots, 2, kvh, hd]
    q, k, v = qkv.clone().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    want_q = reference.rope(q.reshape(3, num_heads, head_dim), positions, rope.cos, rope.sin)
    want_k = reference.rope(k.reshape(3, num_kv_heads, head_dim), positions, rope.cos, rope.sin)
    kernels.rope_write_kv(qkv, num_heads, num_kv_heads, positions, (rope.cos, rope.sin), cache, slots)
    torch.testing.assert_close(qkv[:, : num_heads * head_dim].view(3, num_heads, head_dim), want_q)
    torch.testing.assert_close(cache[slots, 0], want_k)
    assert torch.equal(cache[slots, 1], v.reshape(3, num_kv_heads, head_dim))


def test_rope_write_kv_rounds_into_an_fp16_cache_as_torch_does(kernels: CpuKernels) -> None:
    """An fp16 cache (engine.kv_cache_dtype float16) gets the rotated k and the v rounded to nearest even,
    bit for bit torch's .to(float16), which the torch path's write_kv stores; other slots stay untouched."""
    num_heads, num_kv_heads, head_dim = 3, 1, 64
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    qkv = randn(5, (num_heads + 2 * num_kv_heads) * head_dim, seed=14) * 30  # [M, qkv_size]: some large
    qkv[0, -8:] = torch.tensor([1e-7, 7e4, 65519.0, -(2.0**-24), 2.0**-25, 1.0 + 2.0**-11, 0.0, -0.0])
    positions = torch.tensor([0, 1, 5, 33, 63])  # [M]
    slots = torch.tensor([7, 0, 3, 12, 9])  # [M]
    cache = torch.full((16, 2, num_kv_heads, head_dim), 7.0, dtype=torch.float16)  # [slots, 2, kvh, hd]
    kernels.rope_write_kv(qkv, num_heads, num_kv_heads, positions, (rope.cos, rope.sin), cache, slots)
    kv = qkv[:, num_heads * head_dim :].reshape(5, 2, num_kv_heads, head_dim)  # rotated k, and v
    assert torch.equal(cache[slots].view(torch.int16), kv.to(torch.float16).view(torch.int16))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert bool((cache[untouched] == 7.0).all())


def test_kernels_refuse_a_bf16_cache(kernels: CpuKernels) -> None:
    rope = RotaryEmbedding(16, 8, 10000.0)
    qkv = randn(1, 3 * 16, seed=15)  # [1, qkv_size]: 1 head, 1 kv head
    cache = torch.zeros(4, 2, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 or fp16"):
        kernels.rope_write_kv(qkv, 1, 1, torch.tensor([0]), (rope.cos, rope.sin), cache, torch.tensor([0]))


def test_rope_reference_matches_the_model_rotary_embedding() -> None:
    rope = RotaryEmbedding(16, 64, 10000.0)
    q = randn(4, 3, 16, seed=12)  # [M, heads, hd]
    k = randn(4, 1, 16, seed=13)  # [M, kv_heads, hd]
    positions = torch.tensor([3, 0, 63, 10])  # [M]
    got_q, got_k = rope.apply(q, k, rope.lookup(positions, torch.float32))
    assert torch.equal(got_q, reference.rope(q, positions, rope.cos, rope.sin))
    assert torch.equal(got_k, reference.rope(k, positions, rope.cos, rope.sin))
