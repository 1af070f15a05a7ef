"""The codec extra installs into a fresh venv without torch, and that codec serves a request through a
worker and router running in the project venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.stack_helpers import REPO_ROOT, Proc, free_port, stack_env

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def codec_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("codec-venv")
    # Build from a copy, so setuptools leaves no build/ or egg-info behind in the checkout.
    source = root / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "models", "build", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(REPO_ROOT, source, ignore=skip)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"{source}[codec]"], check=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    return venv


def test_codec_extra_has_no_torch_and_serves_through_the_stack(
    codec_venv: Path, stack: RunningStack, model_dir: Path, tmp_path: Path
) -> None:
    python = codec_venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "torch must not be installed by the codec extra"
    port = free_port()
    args = ["codec", "--model", str(model_dir), "--router", stack.router_address, "--port", str(port)]
    kvrelay_bin = [str(codec_venv / "bin" / "kvrelay")]
    proc = Proc(args, stack_env(TOKEN), tmp_path / "codec.log", command=kvrelay_bin)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
                "prompt": "Hello",
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.stop()
