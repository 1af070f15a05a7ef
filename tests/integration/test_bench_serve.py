"""`kvrelay bench serve` end to end against a real `kvrelay up` stack, at tiny sizes: the mixed workload in
all four protocols (every protocol completes requests, percentiles in order, throughput above zero,
plots written), then a cancellation burst after which the stack must settle, and a two-step sweep whose
report reads the stack's stages. No timing is asserted.
Also: a --url off loopback is refused before anything is sent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.bench.cli import main as bench_main
from services.bench.serve.command import require_loopback
from services.bench.serve.workload import PROTOCOLS
from services.bench.spawn import UpSettings, UpStack, start_up_stack
from tests.conftest import REPO_ROOT

# Alone on the machine: the stack keeps its default 2 s step timeout, which a neighbour's load can push a
# step of these bench runs past (a StepTimeoutError seen with a neighbour beside it).
pytestmark = [pytest.mark.model, pytest.mark.exclusive]

KVRELAY = [sys.executable, "-m", "services.cli.main"]
RESULT_KEYS = {"url", "model", "protocol", "workload", "arrival", "max_tokens", "slo", "seed", "runs"}
RUN_KEYS = {"load", "summary", "by_protocol", "by_kind", "by_tenant", "settle", "requests"}
SUMMARY_KEYS = {
    "requests", "completed", "cancelled", "errors", "timeouts", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
    "wall_s", "requests_per_s", "output_tok_s", "goodput_rps", "slo_attainment", "prompt_tokens",
    "cached_tokens", "prefix_hit_rate", "completion_tokens",
}  # fmt: skip


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    workdir = tmp_path_factory.mktemp("bench-serve-stack")
    config = workdir / "config.yaml"
    config.write_text("engine:\n  kv_cache_memory_mb: 128\n  max_model_len: 2048\n")
    up = start_up_stack(UpSettings(model_dir, config, workdir / "logs"))
    try:
        yield up
    finally:
        up.stop()


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVRELAY, "bench", "serve", "--no-progress", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ordered(distribution: dict[str, Any]) -> bool:
    return distribution["p50"] <= distribution["p90"] <= distribution["p99"]


def test_mix_workload_in_every_protocol(stack: UpStack, tmp_path: Path) -> None:
    out, png = tmp_path / "mix.json", tmp_path / "mix.png"
    args = ["--url", stack.url, "--workload", "mix", "--protocol", "mix", "--num-requests", "8"]
    done = bench(*args, "--max-tokens", "8", "--rate", "4", "--json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TTFT p50/p90/p99 ms" in done.stdout
    result = json.loads(out.read_text())
    assert result.keys() >= RESULT_KEYS
    [run] = result["runs"]
    assert run.keys() >= RUN_KEYS
    summary = run["summary"]
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["requests"] == 8 and summary["errors"] == 0 and summary["timeouts"] == 0
    assert set(run["by_protocol"]) == set(PROTOCOLS)
    for name, side in run["by_protocol"].items():
        assert side["completed"] > 0, (name, side)
        assert side["tokens_from_usage"] and side["prompt_tokens"] > 0, (name, side)
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert _ordered(summary[metric]), (metric, summary[metric])
    assert summary["requests_per_s"] > 0 and summary["output_tok_s"] > 0
    assert 0 <= summary["prefix_hit_rate"] <= 1
    assert run["settle"]["checked"]
    assert png.stat().st_size > 0
    _check_compare(result, tmp_path)


def _check_compare(result: dict[str, Any], tmp_path: Path) -> None:
    """`kvrelay bench compare` on the same result under two labels: every ratio it can form is 1."""
    for label in ("ours", "peer"):
        (tmp_path / f"{label}.json").write_text(json.dumps(result | {"label": label}))
    bench_main(
        ["compare", str(tmp_path / "ours.json"), str(tmp_path / "peer.json"), "--out", str(tmp_path / "cmp")]
    )
    table = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert table["reference"] == "ours" and table["peers"] == ["peer"]
    ratios = [row["ratios"]["peer"] for row in table["rows"] if row["ratios"]["peer"] is not None]
    assert ratios and all(r == 1.0 for r in ratios)
    assert "| ours ÷ peer |" in (tmp_path / "cmp" / "compare.md").read_text()
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0


def test_cancel_burst_settles(stack: UpStack, tmp_path: Path) -> None:
    out = tmp_path / "cancel.json"
    args = ["--url", stack.url, "--workload", "cancel-burst", "--protocol", "mix", "--num-requests", "6"]
    done = bench(*args, "--max-tokens", "64", "--doc-sentences", "8", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run] = json.loads(out.read_text())["runs"]
    assert run["summary"]["requests"] == 6 and run["summary"]["errors"] == 0
    assert run["summary"]["cancelled"] >= 1
    settle = run["settle"]
    assert settle["checked"] and settle["settled"], settle
    assert "settled in" in done.stdout


def test_a_sweep_reads_every_stage_and_reports_where_it_breaks(stack: UpStack, tmp_path: Path) -> None:
    """Closed loop at 1 then 6 clients: each load's stage depths come from the stack itself (the codec's
    admission queue, the router's and the worker's waiting), and the report says where the SLO broke (an
    SLO of 1 ms breaks at once) and which queue grew first, if any."""
    out = tmp_path / "sweep.json"
    args = ["--url", stack.url, "--workload", "qa", "--arrival", "closed", "--sweep", "1,6"]
    done = bench(*args, "--num-requests", "12", "--max-tokens", "8", "--slo-ttft-ms", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [run["load"] for run in result["runs"]] == ["1", "6"]
    for run in result["runs"]:
        stages = run["stages"]
        assert stages and "codec admission" in stages and any("worker-0" in name for name in stages), stages
        assert run["stage_sources"] == ["metrics", "status"]
        assert all(0 <= depth["mean"] <= depth["max"] for depth in stages.values())
    report = result["sweep_report"]
    assert report["stages_read"] == ["metrics", "status"]
    assert report["slo_breaks_at"]["load"] == "1" and "p90 TTFT" in report["slo_breaks_at"]["why"]
    assert "latency breaks the SLO at load 1" in done.stdout
    assert ("first queue to grow:" in done.stdout) == (report["first_queue"] is not None)


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com", "ftp://127.0.0.1/"])
def test_refuses_urls_off_loopback(url: str) -> None:
    with pytest.raises(SystemExit, match="refusing --url"):
        require_loopback(url)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:2", "http://127.9.9.9"]
)
def test_accepts_loopback_urls(url: str) -> None:
    assert require_loopback(url) == url.rstrip("/")


def test_a_deployment_needs_allow_remote_and_a_key() -> None:
    url = "https://kvrelay.example.com/"
    with pytest.raises(SystemExit, match="no --api-key"):
        require_loopback(url, allow_remote=True)
    assert require_loopback(url, allow_remote=True, api_key="sk-test") == url.rstrip("/")
    with pytest.raises(SystemExit, match="refusing --url"):
        require_loopback("ftp://kvrelay.example.com/", allow_remote=True, api_key="sk-test")


def test_cli_refusal_is_one_clear_line() -> None:
    done = bench("--url", "http://192.168.1.10:8000", timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert "refusing --url 'http://192.168.1.10:8000'" in done.stderr and "loopback" in done.stderr
