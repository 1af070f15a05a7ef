"""`kvrelay models info DIR` (docs/models.md): prints the verified manifest as JSON, the same fingerprints
and file hashes the directory's files give; a directory that does not verify is refused, not printed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from services.common.errors import CONFIG_EXIT_CODE
from services.common.manifest import (
    MANIFEST_FORMAT,
    model_fingerprint,
    sha256_file,
    tokenizer_fingerprint,
)
from tests.stack_helpers import REPO_ROOT, stack_env
from tests.tiny_model import make_tiny_llama


def info(model_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO_ROOT / ".venv/bin/kvrelay"), "models", "info", str(model_dir)],
        cwd=REPO_ROOT,
        env=stack_env("info-token"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_prints_the_verified_manifest_of_the_real_model(model_dir: Path) -> None:
    done = info(model_dir)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads((model_dir / "manifest.json").read_text())
    assert printed["format"] == MANIFEST_FORMAT
    files = printed["files"]
    assert set(files) == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.gguf",  # the GGUF kept for model.weights gguf (its Q4_1/Q8_0 blocks as stored)
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):  # the weights: verified by info
        assert files[name] == sha256_file(model_dir / name)
    assert printed["tokenizer_fingerprint"] == tokenizer_fingerprint(files)
    assert printed["model_fingerprint"] == model_fingerprint(files)
    assert printed["source"]["kind"] == "gguf" and printed["source"]["gguf"].endswith(".gguf")


def test_info_refuses_a_directory_whose_files_differ_from_the_manifest(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    tampered = tmp_path / "tampered"
    shutil.copytree(model, tampered)
    (tampered / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    done = info(tampered)
    assert done.returncode == CONFIG_EXIT_CODE and not done.stdout
    assert "kvrelay: ManifestMismatchError: model file 'tokenizer_config.json' does not match" in done.stderr
    assert info(model).returncode == 0
