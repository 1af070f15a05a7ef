"""`kvrelay bench engine` and `kvrelay bench stack`, run through the installed CLI on a tiny random-weight
chat model with the smallest workload each allows: the JSON each writes holds the documented fields,
positive rates, and exactly the tokens asked for (requests x new tokens); bench engine's plot is a PNG."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.manifest import compute_manifest, write_manifest
from tests.stack_helpers import REPO_ROOT, Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "bench-token-0123456789"
KVRELAY_CLI = str(REPO_ROOT / ".venv/bin/kvrelay")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEMPLATE = (
    "{% for m in messages %}t5 {{ m['content'] }} t6 {% endfor %}{% if add_generation_prompt %}t7{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # bench engine's prefill prompts are random IDs in [100, 30000): the vocabulary must hold them.
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), vocab_size=30000)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    write_manifest(path, compute_manifest(path))
    return path


def bench(args: list[str], timeout_s: float = 300) -> None:
    done = subprocess.run(
        [KVRELAY_CLI, "bench", *args],
        cwd=REPO_ROOT,
        env=stack_env(TOKEN),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def assert_rates(side: dict[str, Any], num_requests: int, new_tokens: int) -> None:
    assert side["tok_s"] > 0 and side["ttft_ms"] > 0 and side["e2e_tok_s"] > 0
    assert side["num_tokens"] == num_requests * new_tokens


def test_bench_engine_writes_both_sides_and_a_png(chat_model: Path, tmp_path: Path) -> None:
    out, plot = tmp_path / "engine.json", tmp_path / "engine.png"
    bench(
        [
            "engine",
            "--model",
            str(chat_model),
            "--dtype",
            "float32",
            "--concurrency",
            "1,2",
            "--new-tokens",
            "4",
            "--prefill-tokens",
            "16",
            "--depth",
            "8",
            "--threads",
            "1",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    result = json.loads(out.read_text())
    assert result["model"] == str(chat_model) and result["dtype"] == "float32"
    assert result["precision"] == "float32" and result["threads"] == 1
    assert result["new_tokens"] == 4 and result["prefill_tokens"] == 16 and result["depth"] == 8
    assert result["baseline"] == "transformers generate, bfloat16, sdpa"
    for side in ("kvrelay", "transformers"):
        assert result[side]["prefill_tok_s"] > 0
        assert set(result[side]["decode"]) == {"1", "2"}
        for batch in (1, 2):
            assert_rates(result[side]["decode"][str(batch)], batch, 4)
    assert all(rates["preemptions"] == 0 for rates in result["kvrelay"]["decode"].values())
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture
def stack_url(chat_model: Path, tmp_path: Path) -> Iterator[str]:
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    worker, router, codec_port = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    procs = [
        Proc(["worker", "--model", str(chat_model), "--port", worker.split(":")[1], "--threads", "1"],
             env, tmp_path / "worker.log"),
        Proc(["router", "--port", router.split(":")[1], "--workers", worker], env, tmp_path / "router.log"),
        Proc(["codec", "--model", str(chat_model), "--router", router, "--port", str(codec_port)],
             env, tmp_path / "codec.log"),
    ]  # fmt: skip
    try:
        wait_serving(worker, procs[0])
        wait_serving(router, procs[1])
        url = f"http://127.0.0.1:{codec_port}"
        wait_ready(url, procs[2])
        yield url
    finally:
        for proc in reversed(procs):
            proc.stop()


def wait_ready(url: str, codec: Proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if codec.popen.poll() is not None:
            pytest.fail(f"the codec exited with {codec.popen.returncode}:\n{codec.log()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the codec at {url} was not ready within {timeout_s} s:\n{codec.log()[-3000:]}")


def test_bench_stack_measures_the_stack_the_engine_and_the_baseline(
    chat_model: Path, stack_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "stack.json"
    bench(
        [
            "stack",
            "--url",
            stack_url,
            "--model",
            str(chat_model),
            "--dtype",
            "float32",
            "--concurrency",
            "2",
            "--new-tokens",
            "4",
            "--threads",
            "1",
            "--rounds",
            "1",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "stack.png"),
        ]
    )
    assert (tmp_path / "stack.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    assert result["concurrency"] == 2 and result["new_tokens"] == 4
    stack = result["stack"]
    assert len(stack["rounds"]) == 1 and stack["rounds"][0] == {
        k: v for k, v in stack.items() if k != "rounds"
    }
    assert stack["decode_tok_s"] > 0 and stack["e2e_tok_s"] > 0 and stack["ttft_ms_max"] > 0
    assert stack["num_tokens"] == 2 * 4, "every stream delivered its tokens through the stack"
    assert len(result["engine"]["rounds"]) == 1
    assert_rates(result["engine"]["decode"]["2"], 2, 4)
    assert_rates(result["transformers"]["decode"]["2"], 2, 4)
