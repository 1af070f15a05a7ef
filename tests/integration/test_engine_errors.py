"""Bad input raises a typed error with a clear message and allocates nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.common.errors import (
    CapacityError,
    ContextLengthExceededError,
    CorruptModelError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidSamplingError,
    ManifestMismatchError,
    ModelNotFoundError,
    TokenOutOfRangeError,
)
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_helpers import make_engine
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(tiny_dir: Path) -> EngineCore:
    return make_engine(tiny_dir, "float32", kv_cache_memory_mb=4)


def assert_nothing_allocated(engine: EngineCore) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks.num_active == 0
    engine.check_invariants()


@pytest.mark.parametrize(
    ("prompt", "params", "error", "words"),
    [
        ([], SamplingParams(), EmptyPromptError, "no tokens"),
        ([5, 128], SamplingParams(), TokenOutOfRangeError, "128"),
        ([5, -1], SamplingParams(), TokenOutOfRangeError, "-1"),
        ([5], SamplingParams(max_tokens=0), InvalidSamplingError, "max_tokens"),
        ([5], SamplingParams(max_tokens=-3), InvalidSamplingError, "max_tokens"),
        ([5] * 500, SamplingParams(max_tokens=20), ContextLengthExceededError, "context"),
        ([5], SamplingParams(temperature=-1.0), InvalidSamplingError, "temperature"),
    ],
)
def test_bad_request_raises_a_typed_error_and_allocates_nothing(
    engine: EngineCore, prompt: list[int], params: SamplingParams, error: type, words: str
) -> None:
    with pytest.raises(error, match=words):
        engine.add_request("bad", prompt, params)
    assert_nothing_allocated(engine)


def test_duplicate_request_id_is_refused(engine: EngineCore) -> None:
    engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    engine.abort(["dup"])
    assert_nothing_allocated(engine)


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
