"""Weights kept as GGUF blocks (ops/quant.py) and the C kernels that read them (kernels.c): the torch
reference against gguf's own dequantizer, on random blocks and on the tensors of the SmolLM2 GGUF kvrelay
ships; the kernels against the reference; batch invariance; and quantization error bounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gguf_quants

from services.engine.loading.prepare import default_gguf_path
from services.engine.ops import reference
from services.engine.ops.block_linear import BlockLinear
from services.engine.ops.build import OPTIONAL_CFLAGS, load_cpu_kernels
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from services.engine.ops.quant import (
    BLOCK,
    GGML_TYPES,
    QuantizedWeight,
    WeightFormat,
    can_split,
    cat_rows,
    int8_activations_linear,
    quantize,
    split,
)

GGUF_FORMATS = [WeightFormat.Q8_0, WeightFormat.Q4_1]
FORMATS = [*GGUF_FORMATS, WeightFormat.Q4_1_SPLIT, WeightFormat.Q8_0_SPLIT]  # what the kernels read
STORED = {WeightFormat.Q4_1_SPLIT: WeightFormat.Q4_1, WeightFormat.Q8_0_SPLIT: WeightFormat.Q8_0}
GGML_OF = {WeightFormat.Q8_0: GGMLQuantizationType.Q8_0, WeightFormat.Q4_1: GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA/F16C, which the C kernels need")
    loaded = load_cpu_kernels()
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def gguf_tensors() -> dict[str, object]:
    reader = GGUFReader(default_gguf_path())
    return {tensor.name: tensor for tensor in reader.tensors}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def blocks(weight: torch.Tensor, weight_format: WeightFormat) -> QuantizedWeight:
    """`weight` quantized as `weight_format` (a split format: as stored, then regrouped)."""
    if weight_format in STORED:
        return split(quantize(weight, STORED[weight_format]))
    return quantize(weight, weight_format)


def gguf_dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """gguf's own numpy dequantizer over the same bytes: an implementation that shares nothing with ours."""
    raw = weight.data.numpy()
    values = gguf_quants.dequantize(raw, GGML_OF[weight.format])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(weight.shape)


@pytest.mark.parametrize("weight_format", GGUF_FORMATS)
def test_the_reference_dequantizes_as_gguf_does(weight_format: WeightFormat) -> None:
    weight = quantize(randn(40, 96, seed=1), weight_format)
    torch.testing.assert_close(weight.dequantize(), gguf_dequantized(weight), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("weight_format", "bound"),
    [(WeightFormat.Q8_0, 0.5 / 127), (WeightFormat.Q4_1, 0.5 / 15)],
)
def test_quantizing_errs_by_at_most_half_a_step_of_each_block(
    weight_format: WeightFormat, bound: float
) -> None:
    w = randn(16, 128, seed=2)
    error = (quantize(w, weight_format).dequantize() - w).abs().reshape(16, -1, BLOCK)  # [N, blocks, 32]
    spread = w.reshape(16, -1, BLOCK)
    span = spread.abs().amax(-1) if weight_format == WeightFormat.Q8_0 else spread.amax(-1) - spread.amin(-1)
    # half a step, plus the fp16 rounding of the scale and minimum
    assert bool((error.amax(-1) <= span * bound * 1.01 + 1e-3).all())


def test_the_shipped_gguf_blocks_are_read_as_gguf_reads_them(gguf_tensors: dict[str, object]) -> None:
    """blk.0.attn_q.weight is Q4_1 and token_embd.weight Q8_0 in the SmolLM2 file."""
    seen = set()
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        tensor = gguf_tensors[name]
        weight_format = GGML_TYPES[int(tensor.tensor_type)]  # type: ignore[attr-defined]
        seen.add(weight_format)
        num_cols, num_rows = (int(n) for n in tensor.shape)  # type: ignore[attr-defined]
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(num_rows, -1)  # type: ignore[attr-defined]
        weight = QuantizedWeight(data, weight_format, (num_rows, num_cols))
        expected = torch.from_numpy(
            gguf_quants.dequantize(np.array(tensor.data), tensor.tensor_type)  # type: ignore[attr-defined]
        ).reshape(num_rows, num_cols)
        torch.testing.assert_close(weight.dequantize(), expected.float(), atol=0, rtol=0)
    assert seen == set(GGUF_FORMATS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_format", FORMATS)
def test_the_kernel_dequantizes_exactly_as_the_reference(
    kernels: CpuKernels, weight_format: WeightFormat, dtype: torch.dtype
) -> None:
    """fp32 bit for bit; bf16 as torch rounds the fp32 values (to nearest, ties to even)."""
    weight = blocks(randn(70, 576, seed=3) * 0.05, weight_format)
    expected = weight.dequantize().to(dtype)
    torch.testing.assert_close(kernels.dequantize(weight, dtype=dtype), expected, atol=0, rtol=0)


def test_the_kernel_unpacks_only_to_fp32_or_bf16(kernels: CpuKernels) -> None:
    weight = blocks(randn(4, 64, seed=3), WeightFormat.Q8_0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.dequantize(weight, torch.empty(4, 64, dtype=torch.float16))


def test_a_bf16_unpacking_buffer_multiplies_in_bf16(kernels: CpuKernels) -> None:
    """The torch path's large steps over blocks with a bf16 buffer (CPUs with bf16 in hardware, int8
    activations): x rounded to bf16 times the weights rounded to bf16, the bias added in fp32."""
    x, bias = randn(70, 576, seed=4), randn(37, seed=6)  # [M, K], [N]
    weight = blocks(randn(37, 576, seed=5) * 0.1, WeightFormat.Q4_1_SPLIT)
    linear = BlockLinear(kernels, weight, bias, torch.empty(37 * 576 + 5, dtype=torch.bfloat16))
    expected = F.linear(x.bfloat16(), weight.dequantize().bfloat16()).float() + bias
    out = linear(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_linear_over_blocks_matches_the_reference(
    kernels: CpuKernels, weight_format: WeightFormat, num_tokens: int, in_features: int
) -> None:
    x = randn(num_tokens, in_features, seed=4)  # [M, K]
    weight = blocks(randn(37, in_features, seed=5) * 0.1, weight_format)
    out = torch.empty(num_tokens, 37)  # [M, N]
    kernels.linear(x, weight, out)
    torch.testing.assert_close(out, reference.linear(x, weight.dequantize()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_linear_over_blocks_accumulates_and_reads_strided_rows(
    kernels: CpuKernels, weight_format: WeightFormat
) -> None:
    wide = randn(6, 200, seed=6)  # [M, 200]: x is a column slice with row stride 200
    x = wide[:, 8:136]  # [M, 128]
    weight = blocks(randn(50, 128, seed=7) * 0.1, weight_format)
    residual = randn(6, 50, seed=8)  # [M, N]
    out = residual.clone()
    kernels.linear(x, weight, out, accumulate=True)
    expected = residual + reference.linear(x, weight.dequantize())
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_linear_over_blocks_gives_a_token_the_same_bits_alone_and_in_a_batch(
    kernels: CpuKernels, weight_format: WeightFormat
) -> None:
    x = randn(11, 576, seed=9)  # [M, K]
    weight = blocks(randn(300, 576, seed=10) * 0.1, weight_format)
    batched = torch.empty(11, 300)  # [M, N]
    kernels.linear(x, weight, batched)
    for m in (0, 4, 10):
        alone = torch.empty(1, 300)
        kernels.linear(x[m : m + 1], weight, alone)
        assert torch.equal(alone[0], batched[m])


def test_rows_select_and_concatenate_on_the_stored_bytes() -> None:
    a = blocks(randn(8, 64, seed=11), WeightFormat.Q4_1)
    b = blocks(randn(4, 64, seed=12), WeightFormat.Q4_1)
    joined = cat_rows([a, b])
    torch.testing.assert_close(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = [7, 0, 3]
    torch.testing.assert_close(a.rows(order).dequantize(), a.dequantize()[order])
    with pytest.raises(ValueError, match="one format"):
        cat_rows([a, blocks(randn(4, 64, seed=13), WeightFormat.Q8_0)])


def test_malformed_block_data_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        blocks(randn(4, 40), WeightFormat.Q8_0)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(torch.zeros(4, 33, dtype=torch.uint8), WeightFormat.Q8_0, (4, 32))


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 9])
@pytest.mark.parametrize("in_features", [576, 320])  # 320: 10 blocks, a short last group of split scales
def test_int8_activations_match_their_reference(
    kernels: CpuKernels, weight_format: WeightFormat, num_tokens: int, in_features: int
) -> None:
    x = randn(num_tokens, in_features, seed=14)  # [M, K]
    weight = blocks(randn(45, in_features, seed=15) * 0.1, weight_format)
    out = torch.empty(num_tokens, 45)
    kernels.linear(x, weight, out, int8_activations=True)
    torch.testing.assert_close(out, int8_activations_linear(x, weight), atol=1e-4, rtol=1e-4)
    exact = reference.linear(x, weight.dequantize())
    assert float((out - exact).abs().max()) < 0.02 * float(exact.abs().max())  # int8's own error, bounded


@pytest.mark.parametrize("weight_format", FORMATS)
def test_int8_activations_give_a_token_the_same_bits_alone_and_in_a_batch(
    kernels: CpuKernels, weight_format: WeightFormat
) -> None:
    """A token alone takes the one-token path (rows in pairs, an odd last row alone: 65 rows), and
    adds onto a residual as the batch would."""
    x = randn(7, 576, seed=16)
    weight = blocks(randn(65, 576, seed=17) * 0.1, weight_format)
    batched = torch.empty(7, 65)
    kernels.linear(x, weight, batched, int8_activations=True)
    for m in (0, 6):
        alone = torch.empty(1, 65)
        kernels.linear(x[m : m + 1], weight, alone, int8_activations=True)
        assert torch.equal(alone[0], batched[m])
        residual = randn(1, 65, seed=m)
        summed = residual.clone()
        kernels.linear(x[m : m + 1], weight, summed, accumulate=True, int8_activations=True)
        assert torch.equal(summed, residual + alone)


@pytest.mark.parametrize("stored", GGUF_FORMATS)
def test_split_regroups_the_same_blocks(kernels: CpuKernels, stored: WeightFormat) -> None:
    """A split format holds the stored bytes regrouped: the same weights, and with fp32 activations the same
    bits out of the kernel (only the int8 kernels read it differently)."""
    weight = quantize(randn(30, 320, seed=18) * 0.1, stored)
    regrouped = split(weight)
    assert regrouped.nbytes == weight.nbytes and STORED[regrouped.format] == stored
    assert torch.equal(regrouped.dequantize(), weight.dequantize())
    assert torch.equal(regrouped.rows([4, 1]).dequantize(), weight.dequantize()[[4, 1]])
    x = randn(5, 320, seed=19)
    out_stored, out_split = torch.empty(5, 30), torch.empty(5, 30)
    kernels.linear(x, weight, out_stored)
    kernels.linear(x, regrouped, out_split)
    assert torch.equal(out_stored, out_split)


def test_q4_1_splits_only_with_an_even_number_of_blocks() -> None:
    odd = quantize(randn(4, 96, seed=20), WeightFormat.Q4_1)  # 3 blocks a row
    assert not can_split(odd) and can_split(quantize(randn(4, 96, seed=21), WeightFormat.Q8_0))
    with pytest.raises(ValueError, match="even number of blocks"):
        split(odd)


@pytest.fixture(scope="module")
def avx2_kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The kernels built with none of the optional instruction sets."""
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA/F16C, which the C kernels need")
    loaded = load_cpu_kernels(tmp_path_factory.mktemp("avx2"), flags=cpu_flags() - set(OPTIONAL_CFLAGS))
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("variant", sorted(OPTIONAL_CFLAGS))
def test_each_instruction_set_variant_gives_the_avx2_builds_bits(
    avx2_kernels: CpuKernels, variant: str, tmp_path: Path
) -> None:
    """The int8 dot products take one AVX-VNNI instruction, or AVX512-VNNI's two blocks at once, where the
    CPU has them, maddubs + madd elsewhere: the same integer sums summed in the same order, so the same
    bits on every machine. Every format, tile heights 4 and 1, a short last group of split scales (320)
    and a lone last Q8_0 block (224: 7 blocks; Q4_1 stays unsplit there)."""
    if variant not in cpu_flags():
        pytest.skip(f"this CPU has no {variant}: only builds without it can run here")
    with_variant = load_cpu_kernels(tmp_path, flags=cpu_flags() - set(OPTIONAL_CFLAGS) | {variant})
    assert with_variant is not None
    for in_features in (576, 320, 224):
        x = randn(5, in_features, seed=22)
        for weight_format in FORMATS:
            stored = STORED.get(weight_format, weight_format)
            weight = quantize(randn(70, in_features, seed=23) * 0.1, stored)
            if weight_format in STORED and can_split(weight):
                weight = split(weight)
            with_it, without = torch.empty(5, 70), torch.empty(5, 70)
            with_variant.linear(x, weight, with_it, int8_activations=True)
            avx2_kernels.linear(x, weight, without, int8_activations=True)
            assert torch.equal(with_it, without), (weight.format, in_features)
