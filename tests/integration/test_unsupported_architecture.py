"""A model directory whose config.json names an architecture the engine has no family for is refused with
the documented ModelLoadError (docs/models.md, Errors) that names it and lists the known ones: from the
loader, from `kvrelay worker`, which exits with the config-error code instead of crashing, and from
`kvrelay models prepare --from-dir`, before it writes anything."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from services.common.errors import CONFIG_EXIT_CODE, ModelLoadError
from services.common.manifest import compute_manifest, write_manifest
from services.engine.loading.loader import load_model
from services.engine.loading.prepare import prepare_from_dir
from tests.stack_helpers import REPO_ROOT, free_port, stack_env
from tests.tiny_model import make_tiny_llama
from tests.tiny_t5 import make_tiny_t5

KNOWN = "Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, T5ForConditionalGeneration"
REFUSAL = f"architecture 'MambaForCausalLM' is not supported (known: {KNOWN})"


@pytest.fixture(scope="module")
def mamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("mamba"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    write_manifest(path, compute_manifest(path))  # a consistent, verified directory: only the family is wrong
    return path


def test_the_loader_refuses_an_unknown_architecture(mamba_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as refused:
        load_model(mamba_dir, "float32")
    assert type(refused.value) is ModelLoadError
    assert str(refused.value) == REFUSAL


def test_a_worker_on_an_unknown_architecture_exits_with_the_config_error_code(mamba_dir: Path) -> None:
    done = subprocess.run(
        [
            str(REPO_ROOT / ".venv/bin/kvrelay"),
            "worker",
            "--model",
            str(mamba_dir),
            "--port",
            str(free_port()),
            "--threads",
            "1",
        ],
        cwd=REPO_ROOT,
        env=stack_env("unsupported-token", KVRELAY_MODEL__DTYPE="float32"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr[-2000:]
    assert f"kvrelay: ModelLoadError: {REFUSAL}" in done.stderr
    assert "Traceback" not in done.stderr


def test_prepare_refuses_an_architecture_it_cannot_serve_before_writing(
    mamba_dir: Path, tmp_path: Path
) -> None:
    """`kvrelay models prepare --from-dir` refuses what the loader would, with its message and the config
    error's exit code, and writes nothing; a T5 directory, which the engine serves, it prepares."""
    out = tmp_path / "mamba-out"
    with pytest.raises(ModelLoadError) as refused:
        prepare_from_dir(mamba_dir, out)
    assert str(refused.value) == REFUSAL
    assert not out.exists()
    config = json.loads((mamba_dir / "config.json").read_text())
    src = tmp_path / "mamba-src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes((mamba_dir / "model.safetensors").read_bytes())
    done = subprocess.run(
        [str(REPO_ROOT / ".venv/bin/kvrelay"), "models", "prepare", "--from-dir", str(src)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == CONFIG_EXIT_CODE, done.stderr[-2000:]
    assert f"kvrelay: ModelLoadError: {REFUSAL}" in done.stderr
    assert not (src / "manifest.json").exists()
    t5_dir, _ = make_tiny_t5(tmp_path / "t5-src")
    manifest = prepare_from_dir(t5_dir, tmp_path / "t5-out")
    assert manifest.model_fingerprint and (tmp_path / "t5-out" / "manifest.json").is_file()
