"""engine.deterministic at load (services/engine/loading/deterministic.py): what it refuses, the fingerprint
it serves under, and every step on the C kernels. Its bitwise identity on the real model is
tests/integration/test_deterministic_identity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.cli.status import _weights_cell
from services.common.errors import ConfigError
from services.common.sampling import SamplingParams
from services.engine.loading import deterministic
from services.engine.loading.loader import load_model
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from tests.engine_helpers import generate, make_engine
from tests.tiny_model import make_tiny_llama, make_tiny_qwen3

pytestmark = pytest.mark.skipif(
    not can_run_cpu_kernels(cpu_flags()), reason="the C kernels need AVX2/FMA/F16C"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_cuda_gguf_hybrid_and_bf16_compute_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="refused on CUDA"):
        deterministic.check_device(torch.device("cuda"))
    deterministic.check_device(torch.device("cpu"))
    with pytest.raises(ConfigError, match="gguf-hybrid"):
        deterministic.weights_for("gguf-hybrid", "gguf-hybrid")
    assert deterministic.weights_for("auto", "gguf-hybrid") == "gguf-int8"
    assert deterministic.weights_for("auto", "safetensors") == "safetensors"
    with pytest.raises(ConfigError, match="bfloat16"):
        deterministic.check_dtype("bfloat16")


def test_a_model_the_kernels_do_not_run_is_refused(tmp_path: Path) -> None:
    qwen3 = make_tiny_qwen3(tmp_path / "qwen3")  # q/k norms: the torch path only
    load_model(qwen3, "float32")  # loads without the mode
    with pytest.raises(ConfigError, match=r"engine\.deterministic needs every step on the C kernels"):
        load_model(qwen3, "float32", deterministic=True)


def test_the_mode_serves_under_a_fingerprint_of_its_kernel_build_and_threads(tiny_dir: Path) -> None:
    default = load_model(tiny_dir, "float32")
    chosen = load_model(tiny_dir, "float32", deterministic=True)
    assert default.numerics == "default" and chosen.numerics == "deterministic"
    assert chosen.step_threshold is None
    build = chosen.model.kernels.build_id  # type: ignore[attr-defined]
    assert build.startswith("kernels-")
    fingerprint = chosen.manifest.model_fingerprint
    assert fingerprint == deterministic.numerics_fingerprint(
        default.manifest.model_fingerprint, build, torch.get_num_threads()
    )
    assert fingerprint != default.manifest.model_fingerprint
    assert chosen.manifest.directory_fingerprint == default.manifest.directory_fingerprint
    others = {
        deterministic.numerics_fingerprint(
            default.manifest.model_fingerprint, build, torch.get_num_threads() + 1
        ),
        deterministic.numerics_fingerprint(default.manifest.model_fingerprint, "kernels-other", 2),
    }
    assert fingerprint not in others and len(others) == 2


def test_every_step_runs_on_the_kernels_however_large(tiny_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = {f"r{i}": [(i * 13 + j) % 120 + 2 for j in range(100)] for i in range(4)}  # 400-token steps
    default = make_engine(tiny_dir, kv_cache_memory_mb=8)
    generate(default, prompts, params)
    assert default.stats().steps_by_path["gemm"] > 0
    chosen = make_engine(tiny_dir, kv_cache_memory_mb=8, deterministic=True)
    assert chosen.served.numerics == "deterministic"
    generate(chosen, prompts, params)
    assert chosen.stats().steps_by_path == {"kernels": chosen.stats().num_steps, "gemm": 0}


def test_status_names_the_mode() -> None:
    cell = _weights_cell({"weights": "gguf-int8", "numerics": "deterministic", "weight_bytes": 90 * 2**20})
    assert cell == "gguf-int8(deterministic,90MB)"
    assert _weights_cell({"weights": "gguf-int8", "numerics": "default"}) == "gguf-int8"
