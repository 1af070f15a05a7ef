"""A GGUF's weights read as stored (engine/loading/gguf_weights.py): for the SmolLM2 GGUF kvrelay ships,
every tensor, dequantized, is bit for bit the fp32 tensor transformers made of it in the prepared
directory; Q and K need llama.cpp's row permutation undone; tiny GGUFs written here cover the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants
from safetensors.torch import load_file

from services.common.errors import ModelLoadError
from services.engine.loading.gguf_weights import Weight, keeps_quantized, load_gguf_weights
from services.engine.loading.prepare import default_gguf_path
from services.engine.model_config import ModelConfig
from services.engine.ops.quant import GGML_TYPES, QuantizedWeight, WeightFormat


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


@pytest.fixture(scope="module")
def smollm2(model_dir: Path) -> tuple[dict[str, Weight], dict[str, torch.Tensor]]:
    """(the GGUF's weights read as stored, the prepared directory's fp32 safetensors)."""
    loaded = load_gguf_weights(default_gguf_path(), ModelConfig.from_dir(model_dir))
    reference: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        reference.update(load_file(str(file)))
    return loaded, reference


@pytest.mark.model
def test_every_tensor_dequantizes_to_exactly_what_transformers_made_of_it(
    smollm2: tuple[dict[str, Weight], dict[str, torch.Tensor]],
) -> None:
    loaded, reference = smollm2
    assert set(loaded) == set(reference)  # no lm_head.weight: SmolLM2 ties it to the embeddings
    assert "lm_head.weight" not in loaded
    for name, weight in loaded.items():
        torch.testing.assert_close(dense(weight), reference[name], atol=0, rtol=0, msg=name)


@pytest.mark.model
def test_the_projections_stay_q4_1_blocks_and_the_embeddings_q8_0(
    smollm2: tuple[dict[str, Weight], dict[str, torch.Tensor]],
) -> None:
    loaded, _ = smollm2
    formats = {name: w.format for name, w in loaded.items() if isinstance(w, QuantizedWeight)}
    assert formats.pop("model.embed_tokens.weight") == WeightFormat.Q8_0
    assert len(formats) == 210 and set(formats.values()) == {WeightFormat.Q4_1}
    floats = [w for w in loaded.values() if not isinstance(w, QuantizedWeight)]
    assert len(floats) == 61 and all(w.dtype == torch.float32 and w.dim() == 1 for w in floats)
    q = loaded["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.shape == (576, 576)
    assert q.data.untyped_storage().nbytes() == q.nbytes  # its own copy, not a view of the file


@pytest.fixture(scope="module")
def stored_q_and_k() -> dict[str, QuantizedWeight]:
    """Q and K of three layers with their rows as the file stores them (one read: parsing takes seconds)."""
    stored = {}
    for tensor in GGUFReader(default_gguf_path()).tensors:
        layer, _, part = tensor.name.removeprefix("blk.").partition(".")
        if part in ("attn_q.weight", "attn_k.weight") and layer in ("0", "17", "29"):
            num_cols, num_rows = (int(n) for n in tensor.shape)
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # [N, K // 32 * 20]
            stored[tensor.name] = QuantizedWeight(
                data, GGML_TYPES[int(tensor.tensor_type)], (num_rows, num_cols)
            )
    return stored


@pytest.mark.model
@pytest.mark.parametrize("layer", [0, 17, 29])
@pytest.mark.parametrize(("gguf_part", "hf_part"), [("attn_q", "q_proj"), ("attn_k", "k_proj")])
def test_q_and_k_rows_really_needed_unpermuting(
    smollm2: tuple[dict[str, Weight], dict[str, torch.Tensor]],
    stored_q_and_k: dict[str, QuantizedWeight],
    layer: int,
    gguf_part: str,
    hf_part: str,
) -> None:
    """The rows as the file stores them are not transformers' Q/K; the loaded ones are."""
    loaded, reference = smollm2
    name = f"model.layers.{layer}.self_attn.{hf_part}.weight"
    stored = stored_q_and_k[f"blk.{layer}.{gguf_part}.weight"]
    assert not torch.equal(stored.dequantize(), reference[name])
    assert torch.equal(dense(loaded[name]), reference[name])


def tiny_config(num_layers: int = 1) -> ModelConfig:
    """A llama of hidden 64: 2 query heads and 1 KV head of 32."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to Q and K rows."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]], arch: str = "llama"
) -> Path:
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tiny_llama_comes_back_in_hf_order_with_its_names(tmp_path: Path) -> None:
    """Independent of transformers: HF tensors permuted as llama.cpp does, stored, and read back."""
    rng = np.random.default_rng(0)
    hf = {
        "q": rng.standard_normal((64, 64), dtype=np.float32),  # [heads * head_dim, hidden]
        "k": rng.standard_normal((32, 64), dtype=np.float32),  # [kv_heads * head_dim, hidden]
        "k_bias": rng.standard_normal(32, dtype=np.float32),
        "out": rng.standard_normal((8, 64), dtype=np.float32),
    }
    q_stored = gguf_quants.quantize(llama_cpp_permute(hf["q"], 2), GGMLQuantizationType.Q4_1)
    path = write_gguf(
        tmp_path / "tiny.gguf",
        {
            "blk.0.attn_q.weight": (q_stored, GGMLQuantizationType.Q4_1),
            "blk.0.attn_k.weight": (llama_cpp_permute(hf["k"], 1).astype(np.float16), None),
            "blk.0.attn_k.bias": (llama_cpp_permute(hf["k_bias"], 1), None),
            "output.weight": (
                gguf_quants.quantize(hf["out"], GGMLQuantizationType.Q8_0),
                GGMLQuantizationType.Q8_0,
            ),
        },
    )
    loaded = load_gguf_weights(path, tiny_config())
    assert set(loaded) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
        "lm_head.weight",
    }
    q = loaded["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.format == WeightFormat.Q4_1
    # Rows quantize independently, so HF-order rows quantized equal the stored rows put back in order.
    q_expected = gguf_quants.dequantize(
        gguf_quants.quantize(hf["q"], GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1
    )
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(q_expected), atol=0, rtol=0)
    k = loaded["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k, torch.Tensor) and k.dtype == torch.float32
    torch.testing.assert_close(
        k, torch.from_numpy(hf["k"].astype(np.float16).astype(np.float32)), atol=0, rtol=0
    )
    torch.testing.assert_close(
        loaded["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(hf["k_bias"]), atol=0, rtol=0
    )
    lm_head = loaded["lm_head.weight"]
    assert isinstance(lm_head, QuantizedWeight) and lm_head.format == WeightFormat.Q8_0


def test_keeps_quantized_for_the_shipped_smollm2_file() -> None:
    assert keeps_quantized(default_gguf_path())


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.BF16])
def test_a_type_the_kernels_cannot_read_is_not_kept(tmp_path: Path, ggml_type: GGMLQuantizationType) -> None:
    block_bytes = {GGMLQuantizationType.Q5_0: 22, GGMLQuantizationType.BF16: 64}[ggml_type]  # per 32 weights
    path = write_gguf(
        tmp_path / "mixed.gguf",
        {
            "token_embd.weight": (np.zeros((8, 64), np.float32), None),
            "blk.0.attn_q.weight": (np.zeros((64, 2 * block_bytes), np.uint8), ggml_type),
        },
    )
    assert not keeps_quantized(path)
    with pytest.raises(ModelLoadError, match=ggml_type.name):
        load_gguf_weights(path, tiny_config())


def test_an_unknown_tensor_name_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "odd.gguf",
        {
            "token_embd.weight": (np.zeros((8, 64), np.float32), None),
            "blk.0.attn_mystery.weight": (np.zeros((8, 64), np.float32), None),
            "blk.1.attn_norm.weight": (np.zeros(64, np.float32), None),  # past the config's one layer
        },
    )
    assert keeps_quantized(path)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_mystery\.weight.*blk\.1\.attn_norm\.weight"):
        load_gguf_weights(path, tiny_config())


def test_another_architecture_is_refused(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "qwen.gguf", {"token_embd.weight": (np.zeros((8, 64), np.float32), None)}, arch="qwen2"
    )
    with pytest.raises(ModelLoadError, match="'qwen2'"):
        load_gguf_weights(path, tiny_config())


def test_q_rows_that_do_not_match_the_heads_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "wide.gguf", {"blk.0.attn_q.weight": (np.zeros((96, 64), np.float32), None)})
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight has 96 rows"):
        load_gguf_weights(path, tiny_config())
