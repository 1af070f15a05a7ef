"""The API fuzzed on the live stack (issue 54): scripts/fuzz_api.py reads the codec's own OpenAPI document
(GET /openapi.json) and sends 50 schemathesis-generated requests per operation (seed 0: the same run every
time) to a codec process of its own on the end-to-end stack's router and worker (the real model, output
capped at 4 tokens). Every answer is a 2xx or a 4xx in its protocol's shape: no 5xx, no hang. A failing
case found here (or by the script's longer runs) becomes a regression test in
tests/unit/test_text_properties.py or its protocol's tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.stack_helpers import Proc, free_port, stack_env

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 50


@pytest.fixture
def codec(stack: RunningStack, model_dir: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = stack_env(
        TOKEN,
        KVRELAY_LIMITS__MAX_OUTPUT_TOKENS="4",
        KVRELAY_LIMITS__DEFAULT_MAX_OUTPUT_TOKENS="4",
        KVRELAY_LIMITS__MAX_INPUT_TOKENS="512",
    )
    args = ["codec", "--model", str(model_dir), "--router", stack.router_address, "--port", str(port)]
    proc = Proc(args, env, tmp_path / "codec.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc)
        yield url
    finally:
        proc.stop()


def test_the_openapi_document_names_every_generation_route(codec: str) -> None:
    document = httpx.get(f"{codec}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    }
    served = httpx.get(f"{codec}/v1/models").json()["data"][0]["id"]
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == [served]


def test_fifty_generated_requests_per_operation_get_no_server_error(codec: str, tmp_path: Path) -> None:
    report_path = tmp_path / "fuzz.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz_api.py"), "--url", codec, "--examples", str(EXAMPLES),
         "--seed", "0", "--timeout", "60", "--json", str(report_path)],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
    )  # fmt: skip
    assert report_path.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["failures"] == [], done.stderr[-4000:]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(report["operations"]) >= 6
    for name, ran in report["operations"].items():
        assert ran["cases"] >= EXAMPLES * 0.8, (name, ran)  # hypothesis may dedupe a few
        assert all(200 <= int(status) < 500 for status in ran["statuses"]), (name, ran)
    assert any("200" in ran["statuses"] for ran in report["operations"].values())  # some went through
