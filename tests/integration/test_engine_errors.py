"""A model directory that is missing, tampered with or corrupt, or a KV budget too small for it, is refused
with a typed error. (Bad requests: tests/unit/test_engine_validation.py, on the fake runner.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.common.errors import CapacityError, CorruptModelError, ManifestMismatchError, ModelNotFoundError
from tests.engine_helpers import make_engine
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_unknown_model_directory_is_a_model_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        make_engine(tmp_path / "nope")


def test_tampered_weight_file_is_refused_naming_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestMismatchError, match=r"model\.safetensors"):
        make_engine(copy)


def test_corrupt_config_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    from services.common.manifest import compute_manifest, write_manifest

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    (copy / "config.json").write_text("{not json")
    write_manifest(copy, compute_manifest(copy))
    with pytest.raises(CorruptModelError, match=r"config\.json"):
        make_engine(copy)


def test_kv_budget_below_one_full_sequence_is_refused(tmp_path: Path) -> None:
    long_context = make_tiny_llama(tmp_path / "long", max_position_embeddings=65536)
    with pytest.raises(CapacityError, match="kv_cache_memory_mb"):
        make_engine(long_context, kv_cache_memory_mb=1)
