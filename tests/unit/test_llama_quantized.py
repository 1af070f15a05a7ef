"""LlamaModel over GGUF blocks (Q4_1 projections, Q8_0 tied embeddings, as in SmolLM2's GGUF) against the
same model over the blocks' dequantized fp32 values: the kernel path (small steps) and the torch path
(large steps, each matrix unpacked into a shared buffer) give the same logits, and the blocks are all the
model keeps (no float copy of the projections)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.errors import ModelLoadError
from services.engine.layers.attention_metadata import AttentionMetadata, RowSpec, build_metadata
from services.engine.model_config import ModelConfig
from services.engine.models.llama import LlamaModel
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags, has_native_bf16_matmul
from services.engine.ops.quant import QuantizedWeight, WeightFormat, quantize
from tests.engine_helpers import count_unpacking
from tests.tiny_model import make_tiny_llama

BLOCK_SIZE = 4
NUM_BLOCKS = 48
SHAPE = {"hidden_size": 64, "intermediate_size": 128}  # K % 32 == 0 for every matrix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA/F16C, which the C kernels need")
    assert load_cpu_kernels() is not None
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-q"), tie_word_embeddings=True, **SHAPE)


def blocks_of(path: Path) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The tiny model's weights as SmolLM2's GGUF stores them: projections Q4_1, embeddings Q8_0."""
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            weights[name] = quantize(tensor, WeightFormat.Q4_1)
        elif name == "model.embed_tokens.weight":
            weights[name] = quantize(tensor, WeightFormat.Q8_0)
        else:
            weights[name] = tensor
    return weights


def dequantized(weights: dict[str, torch.Tensor | QuantizedWeight]) -> dict[str, torch.Tensor]:
    return {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in weights.items()}


def caches(model: LlamaModel) -> list[torch.Tensor]:
    cfg = model.config
    return [
        torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)
    ]


def steps() -> list[tuple[list[RowSpec], list[RowSpec]]]:
    a, b = [17, 3, 40, 8], [5, 33, 21]
    return [
        ([], [RowSpec(a, 0, 7), RowSpec(b, 0, 5)]),
        ([RowSpec(a, 7, 1), RowSpec(b, 5, 1)], []),
        ([RowSpec(a, 8, 1)], [RowSpec(b, 6, 4)]),
    ]


def step_inputs(vocab_size: int, seed: int) -> Iterator[tuple[AttentionMetadata, torch.Tensor, torch.Tensor]]:
    """Each of `steps()` as (metadata, random token IDs, every token's logits index)."""
    g = torch.Generator().manual_seed(seed)
    for decode, prefill in steps():
        meta = build_metadata(decode, prefill, BLOCK_SIZE)
        token_ids = torch.randint(0, vocab_size, (meta.num_tokens,), generator=g)  # [num_tokens]
        yield meta, token_ids, torch.arange(meta.num_tokens)  # [num_tokens] twice


@pytest.mark.parametrize("small_step_max_tokens", [64, 0], ids=["kernel-path", "torch-path"])
def test_blocks_give_the_logits_of_their_dequantized_values(tiny: Path, small_step_max_tokens: int) -> None:
    config = ModelConfig.from_dir(tiny)
    weights = blocks_of(tiny)
    quant = LlamaModel(config, weights, torch.float32, small_step_max_tokens=small_step_max_tokens)
    plain = LlamaModel(
        config, dequantized(weights), torch.float32, small_step_max_tokens=small_step_max_tokens
    )
    assert quant.weight_format == WeightFormat.Q4_1_SPLIT  # the Q4_1 projections, regrouped at load
    quant_caches, plain_caches = caches(quant), caches(plain)
    for meta, token_ids, logits_indices in step_inputs(config.vocab_size, 0):
        got = quant.forward(token_ids, quant_caches, meta, logits_indices)
        want = plain.forward(token_ids, plain_caches, meta, logits_indices)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_model_keeps_only_the_blocks(tiny: Path) -> None:
    weights = blocks_of(tiny)
    model = LlamaModel(ModelConfig.from_dir(tiny), weights, torch.float32)
    block_bytes = sum(w.nbytes for w in weights.values() if isinstance(w, QuantizedWeight))
    float_bytes = sum(t.numel() * 4 for t in weights.values() if isinstance(t, torch.Tensor))
    assert model.weight_bytes <= block_bytes + float_bytes  # norms only besides the blocks
    assert all(isinstance(w, QuantizedWeight) for w in (model.layers[0].qkv_proj, model.lm_head))


def test_blocks_need_fp32_compute(tiny: Path) -> None:
    with pytest.raises(ModelLoadError, match="float32"):
        LlamaModel(ModelConfig.from_dir(tiny), blocks_of(tiny), torch.bfloat16)


def test_int8_activations_stay_near_the_fp32_logits(tiny: Path) -> None:
    """The decode kernels on int8 activations (gguf-int8): each logit within a small share of the logits'
    range of the fp32-activation model over the same blocks (top-1 agreement is measured on the real model,
    tests/integration/test_gguf_quality.py: a random model's logits are all near-ties)."""
    config = ModelConfig.from_dir(tiny)
    weights = blocks_of(tiny)
    int8 = LlamaModel(config, weights, torch.float32, int8_activations=True)
    fp32 = LlamaModel(config, weights, torch.float32)
    int8_caches, fp32_caches = caches(int8), caches(fp32)
    for meta, token_ids, logits_indices in step_inputs(config.vocab_size, 1):
        got = int8.forward(token_ids, int8_caches, meta, logits_indices)
        want = fp32.forward(token_ids, fp32_caches, meta, logits_indices)
        spread = float(want.max() - want.min())
        assert float((got - want).abs().max()) < 0.05 * spread


def test_int8_activations_need_blocks(tiny: Path) -> None:
    weights = dequantized(blocks_of(tiny))
    with pytest.raises(ModelLoadError, match="int8"):
        LlamaModel(ModelConfig.from_dir(tiny), weights, torch.float32, int8_activations=True)


def test_hybrid_large_steps_read_the_copy_unpacked_at_load(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gguf-hybrid: large steps give gguf-int8's logits bit for bit (it unpacks each matrix per step into a
    buffer of the dtype this CPU's copy has), yet nothing is unpacked once the model is loaded; small steps
    run the kernels, and each step is counted under its path."""
    config = ModelConfig.from_dir(tiny)
    weights = blocks_of(tiny)
    dtype = torch.bfloat16 if has_native_bf16_matmul(cpu_flags()) else torch.float32
    calls = count_unpacking(monkeypatch)
    hybrid = LlamaModel(
        config, weights, torch.float32, int8_activations=True, unpacked_dtype=dtype, small_step_max_tokens=2
    )
    per_step = LlamaModel(config, weights, torch.float32, int8_activations=True, small_step_max_tokens=2)
    elem = torch.empty((), dtype=dtype).element_size()
    matrices = [w for w in weights.values() if isinstance(w, QuantizedWeight)]
    assert hybrid.unpacked_bytes == sum(w.shape[0] * w.shape[1] for w in matrices) * elem
    assert hybrid.weight_bytes >= per_step.weight_bytes + hybrid.unpacked_bytes
    hybrid_caches, per_step_caches = caches(hybrid), caches(per_step)
    for meta, token_ids, logits_indices in step_inputs(config.vocab_size, 2):
        before = calls["calls"]
        got = hybrid.forward(token_ids, hybrid_caches, meta, logits_indices)
        assert calls["calls"] == before, "a gguf-hybrid step unpacked a matrix"
        want = per_step.forward(token_ids, per_step_caches, meta, logits_indices)
        assert torch.equal(got, want)
    assert calls["calls"] > 0  # gguf-int8's large steps did unpack: the counter sees it
    assert hybrid.num_steps_by_path == {"kernels": 1, "gemm": 2}  # 12 tokens, then 2, then 5


def test_load_time_unpacking_needs_blocks(tiny: Path) -> None:
    weights = dequantized(blocks_of(tiny))
    with pytest.raises(ModelLoadError, match="gguf-hybrid"):
        LlamaModel(ModelConfig.from_dir(tiny), weights, torch.float32, unpacked_dtype=torch.float32)
