"""`kvrelay bench kv-tiers` end to end on the real model, at tiny sizes, on its shared-tier side alone (the
side without tiers runs the same code with one setting less, and the suite's time is short): a stack with a
cache Redis of its own, through a worker restart and a rescale to a second replica. Checks the JSON's
shape, that every turn was served, that the restarted worker loaded the conversation from the shared tier,
the PNG, and that no process outlived the run. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_helpers import no_process_holds_open, run_kvrelay

pytestmark = pytest.mark.model

PHASE_KEYS = {
    "requests", "prompt_tokens", "cached_tokens", "hit_rate", "ttft_p50_s", "ttft_p99_s",
    "tier_fetched_tokens", "errors",
}  # fmt: skip


def test_bench_kv_tiers_measures_a_restart_and_a_rescale_with_the_shared_tier(
    model_dir: Path, tmp_path: Path
) -> None:
    out, png, logs = tmp_path / "kv-tiers.json", tmp_path / "kv-tiers.png", tmp_path / "logs"
    args = [
        *(
            "bench",
            "kv-tiers",
            "--model",
            str(model_dir),
            "--sides",
            "shared",
            "--sessions",
            "1",
            "--turns",
            "3",
        ),
        *(
            "--max-tokens",
            "2",
            "--system-tokens",
            "32",
            "--first-user-tokens",
            "160",
            "--segment-tokens",
            "64",
        ),
        *("--json", str(out), "--plot", str(png), "--logs", str(logs)),
    ]
    done = run_kvrelay(args, timeout_s=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TTFT p50 ms" in done.stdout and "rescale" in done.stdout
    result = json.loads(out.read_text())
    assert result.keys() >= {"model", "workload", "segment_tokens", "sides"}
    assert list(result["sides"]) == ["shared"]
    for phases in result["sides"].values():
        assert list(phases) == ["warm", "restart", "rescale"]
        for phase in phases.values():
            assert phase.keys() >= PHASE_KEYS
            assert phase["errors"] == [] and phase["requests"] == 1 and phase["prompt_tokens"] > 0
    shared = result["sides"]["shared"]
    assert shared["warm"]["tier_fetched_tokens"] == 0
    restart = shared["restart"]  # the restarted worker loaded the conversation so far from the shared tier
    assert (
        restart["tier_fetched_tokens"] >= 128 and restart["cached_tokens"] >= restart["tier_fetched_tokens"]
    )
    assert png.stat().st_size > 0
    assert no_process_holds_open(logs)
