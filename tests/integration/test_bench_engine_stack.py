"""`kvrelay bench engine` and `kvrelay bench stack`, run through the installed CLI on a tiny random-weight
chat model with the smallest workload each allows: the JSON each writes holds the documented fields,
positive rates, and exactly the tokens asked for (requests x new tokens); bench engine's plot is a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
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


PEER_STAND_IN = """#!{python}
import json, sys, time
argv = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps({{"argv": argv, "at": time.time()}}) + "\\n")
rows = [{{"n_prompt": 16, "n_gen": 0, "n_depth": 0, "avg_ts": 50.0}},
        {{"n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ts": 5.0}}]
print(json.dumps(rows))
"""


def test_bench_engine_rounds_take_turns_with_the_peer(chat_model: Path, tmp_path: Path) -> None:
    # llama.cpp is never built in CI: a stand-in llama-bench (the seam) logs when it ran and with what.
    calls, stand_in = tmp_path / "calls.jsonl", tmp_path / "llama-bench"
    stand_in.write_text(PEER_STAND_IN.format(python=sys.executable, log=str(calls)))
    stand_in.chmod(0o755)
    out = tmp_path / "engine.json"
    bench(
        ["engine", "--model", str(chat_model), "--dtype", "float32", "--concurrency", "1",
         "--new-tokens", "4", "--prefill-tokens", "16", "--threads", "1", "--rounds", "2",
         "--no-baseline", "--peer", "llama.cpp", str(stand_in), "--json", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    peer_calls = [json.loads(line) for line in calls.read_text().splitlines()]
    ours = result["kvrelay"]["rounds"]
    assert result["rounds"] == 2 and len(result["bandwidth_rounds_gb_s"]) == 2 and len(ours) == 2
    assert [c["argv"][c["argv"].index("-r") + 1] for c in peer_calls] == ["1", "1"]
    # taking turns: ours, the peer, ours, the peer
    assert ours[0]["started"] < peer_calls[0]["at"] < ours[1]["started"] < peer_calls[1]["at"]
    for one in ours:
        assert_rates(one["decode"]["1"], 1, 4)
    rates = sorted(r["decode"]["1"]["tok_s"] for r in ours)
    assert rates[0] <= result["kvrelay"]["decode"]["1"]["tok_s"] <= rates[1]
    assert result["llama.cpp"]["decode"]["1"]["tok_s"] == 5.0
    assert len(result["llama.cpp"]["rounds"]) == 2


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
