"""`kvrelay bench routing` end to end on the real model, at tiny sizes: two `kvrelay up` stacks (cost, then
round_robin), one session of 4 turns (sent one after another, so nothing but the policy decides where a
turn lands). Checks the JSON's shape, that both policies served every turn with positive prompt token
counts, that the cost policy's prefix index beats round-robin on prefix-cache hit rate, the PNG and that
no process outlived the run; no timing is asserted.

Round-robin alternates the two workers, so each follow-up finds at most the turn before last cached
(the first follow-up: nothing); the cost policy keeps the conversation where its prefix is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_helpers import no_process_holds_open, run_kvrelay

pytestmark = pytest.mark.model

SIDE_KEYS = {
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "first_turns",
    "follow_ups",
    "ttft_p50_s",
    "ttft_p99_s",
    "follow_up_ttft_p50_s",
    "wall_s",
    "completion_tokens",
    "completion_tok_s",
    "requests_per_s",
    "errors",
    "workers",
    "routing_reasons",
    "foreign_reasons",
    "up_exit_code",
    "turns",
}


def test_bench_routing_measures_both_policies(model_dir: Path, tmp_path: Path) -> None:
    out, png, logs = tmp_path / "routing.json", tmp_path / "routing.png", tmp_path / "logs"
    args = [
        *("bench", "routing", "--model", str(model_dir), "--sessions", "1", "--turns", "4"),
        *("--max-tokens", "4", "--system-tokens", "64", "--first-user-tokens", "48"),
        *("--json", str(out), "--plot", str(png), "--logs", str(logs)),
    ]
    done = run_kvrelay(args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TTFT p50 ms" in done.stdout and "round_robin" in done.stdout
    result = json.loads(out.read_text())
    assert result.keys() >= {"model", "workers", "kv_cache_mb", "workload", "policies"}
    assert list(result["policies"]) == ["cost", "round_robin"]
    for side in result["policies"].values():
        assert side.keys() >= SIDE_KEYS
        assert side["errors"] == [] and side["up_exit_code"] == 0
        assert side["requests"] == 4 and side["prompt_tokens"] > 0
        assert side["follow_ups"]["requests"] == 3 and side["follow_ups"]["prompt_tokens"] > 0
        assert all(turn["prompt_tokens"] > 0 for turn in side["turns"])
        assert set(side["workers"]) == {"worker-0", "worker-1"}
        assert sum(side["routing_reasons"].values()) == 4
        assert not side["foreign_reasons"], side["foreign_reasons"]
    cost, round_robin = result["policies"]["cost"], result["policies"]["round_robin"]
    hit_rates = {p: (s["hit_rate"], s["follow_ups"]["hit_rate"]) for p, s in result["policies"].items()}
    assert cost["routing_reasons"].get("prefix_overlap", 0) >= 1, cost["routing_reasons"]
    assert cost["hit_rate"] > round_robin["hit_rate"], hit_rates
    assert cost["follow_ups"]["hit_rate"] > round_robin["follow_ups"]["hit_rate"], hit_rates
    assert png.stat().st_size > 0
    assert no_process_holds_open(logs)
