"""Shared fixtures. Tests that need the real model use `model_dir` (made by `make setup`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"


def _model_dir() -> Path:
    return Path(os.environ.get("KVRELAY_TEST_MODEL_DIR", str(DEFAULT_MODEL_DIR)))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared default model directory. Missing means setup did not run: that is a failure."""
    path = _model_dir()
    if not (path / "manifest.json").exists():
        pytest.fail(f"prepared model not found at {path}; run `make setup` first")
    return path
