"""The manifest: file hashes, the two fingerprints, and verification of a model directory."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from services.common.errors import CorruptModelError, ManifestMismatchError, ModelNotFoundError
from services.common.manifest import (
    MANIFEST_NAME,
    UNKNOWN_FINGERPRINT,
    Manifest,
    compute_manifest,
    load_verified_manifest,
    sha256_file,
    write_manifest,
)

FILES: dict[str, str | bytes] = {
    "config.json": '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}',
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": '{"eos_token": "<|im_end|>"}',
    "chat_template.jinja": "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
    "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      weights",
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny fake model directory with no manifest (shadows the real-model fixture on purpose)."""
    root = tmp_path / "model"
    root.mkdir()
    for name, content in FILES.items():
        path = root / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


@pytest.fixture
def prepared_dir(model_dir: Path) -> Path:
    write_manifest(model_dir, compute_manifest(model_dir, source={"gguf": "fake.gguf"}))
    return model_dir


def test_sha256_file_matches_hashlib_across_chunks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # > 2 MiB: several 1 MiB chunks
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_fingerprints_are_stable_across_calls(model_dir: Path) -> None:
    first, second = compute_manifest(model_dir), compute_manifest(model_dir)
    assert first == second
    assert len(first.tokenizer_fingerprint) == 64
    assert first.tokenizer_fingerprint != first.model_fingerprint


def test_manifest_lists_tokenizer_config_and_weights_only(model_dir: Path) -> None:
    (model_dir / "README.md").write_text("not served", encoding="utf-8")
    manifest = compute_manifest(model_dir)
    assert sorted(manifest.files) == sorted(FILES)


def test_weight_change_changes_model_fingerprint_only(model_dir: Path) -> None:
    before = compute_manifest(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    after = compute_manifest(model_dir)
    assert after.model_fingerprint != before.model_fingerprint
    assert after.tokenizer_fingerprint == before.tokenizer_fingerprint


def test_template_change_changes_both_fingerprints(model_dir: Path) -> None:
    before = compute_manifest(model_dir)
    (model_dir / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    after = compute_manifest(model_dir)
    assert after.tokenizer_fingerprint != before.tokenizer_fingerprint
    assert after.model_fingerprint != before.model_fingerprint


def test_json_round_trip_keeps_every_field(prepared_dir: Path) -> None:
    manifest = compute_manifest(prepared_dir, source={"gguf": "fake.gguf"})
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert (prepared_dir / MANIFEST_NAME).read_text(encoding="utf-8") == manifest.to_json()


def test_verified_manifest_is_the_written_one(prepared_dir: Path) -> None:
    manifest = load_verified_manifest(prepared_dir)
    assert manifest == compute_manifest(prepared_dir, source={"gguf": "fake.gguf"})
    assert manifest.source == {"gguf": "fake.gguf"}


def test_tampered_file_raises_mismatch_naming_it(prepared_dir: Path) -> None:
    (prepared_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}', encoding="utf-8")
    with pytest.raises(ManifestMismatchError, match=r"tokenizer_config\.json") as info:
        load_verified_manifest(prepared_dir)
    assert info.value.file_name == "tokenizer_config.json"


def test_unlisted_weights_file_raises_mismatch(prepared_dir: Path) -> None:
    (prepared_dir / "extra.safetensors").write_bytes(b"smuggled")
    with pytest.raises(ManifestMismatchError, match=r"extra\.safetensors"):
        load_verified_manifest(prepared_dir)


def test_missing_listed_file_raises_not_found_naming_it(prepared_dir: Path) -> None:
    (prepared_dir / "chat_template.jinja").unlink()
    with pytest.raises(ModelNotFoundError, match=r"chat_template\.jinja"):
        load_verified_manifest(prepared_dir)


def test_missing_directory_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        load_verified_manifest(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_missing_required_file_raises_not_found_naming_it(model_dir: Path, name: str) -> None:
    (model_dir / name).unlink()
    with pytest.raises(ModelNotFoundError, match=name.replace(".", r"\.")):
        load_verified_manifest(model_dir)


def test_missing_weights_raise_not_found(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_verified_manifest(model_dir)


def test_unparsable_manifest_raises_corrupt(model_dir: Path) -> None:
    (model_dir / MANIFEST_NAME).write_text("{not json", encoding="utf-8")
    with pytest.raises(CorruptModelError, match=MANIFEST_NAME):
        load_verified_manifest(model_dir)


def test_manifest_with_forged_fingerprint_raises_corrupt(prepared_dir: Path) -> None:
    body = json.loads((prepared_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    body["model_fingerprint"] = "0" * 64
    (prepared_dir / MANIFEST_NAME).write_text(json.dumps(body), encoding="utf-8")
    with pytest.raises(CorruptModelError, match="model_fingerprint"):
        load_verified_manifest(prepared_dir)


def test_without_manifest_one_is_computed_and_logged(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="services.common.manifest"):
        manifest = load_verified_manifest(model_dir)
    assert manifest == compute_manifest(model_dir)
    assert manifest.tokenizer_fingerprint in caplog.text
    assert not (model_dir / MANIFEST_NAME).exists()


def test_tokenizer_scope_ignores_weights(prepared_dir: Path) -> None:
    expected = load_verified_manifest(prepared_dir)
    (prepared_dir / "model.safetensors").write_bytes(b"tampered weights")
    manifest = load_verified_manifest(prepared_dir, scope="tokenizer")
    assert manifest == expected
    with pytest.raises(ManifestMismatchError, match=r"model\.safetensors"):
        load_verified_manifest(prepared_dir)


def test_tokenizer_scope_still_checks_tokenizer_files(prepared_dir: Path) -> None:
    (prepared_dir / "chat_template.jinja").write_text("changed", encoding="utf-8")
    with pytest.raises(ManifestMismatchError, match=r"chat_template\.jinja"):
        load_verified_manifest(prepared_dir, scope="tokenizer")


def test_tokenizer_scope_without_manifest_needs_no_weights(model_dir: Path) -> None:
    full = compute_manifest(model_dir)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "config.json").unlink()
    manifest = load_verified_manifest(model_dir, scope="tokenizer")
    assert manifest.tokenizer_fingerprint == full.tokenizer_fingerprint
    assert manifest.model_fingerprint == UNKNOWN_FINGERPRINT
    assert "model.safetensors" not in manifest.files
