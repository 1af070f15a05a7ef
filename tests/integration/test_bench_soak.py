"""`kvrelay bench soak` end to end on the real model, the CI-sized version (90 s of traffic): the whole
local stack under the mixed traffic (every protocol, tools, structured output, 15% cancels), a quarter of
it through a second codec with the test-only leak switch on. The verdict must flag that codec's RSS as
growing (the switch keeps 64 KB per request), while the end state is all zero
for both codecs and the worker (no running request, open quota reservation, client connection or active KV
block), no request met a server error, at least 10% were cancelled, and no process outlives the run.
Whether the other processes are flat after 30 s of warm-up is not asserted: a 90-second run is too short
to tell start-up growth from a leak (the 30-minute run in the issue's note does). No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_helpers import no_process_holds_open, run_kvrelay

# Alone on the machine: the stack keeps its default 2 s step timeout, and any server error fails the soak.
pytestmark = [pytest.mark.model, pytest.mark.exclusive]

END_STATE_KEYS = {
    "codec_running", "codec_queued", "quota_open_reservations", "quota_reserved_tokens",
    "codec_client_connections", "worker_running", "worker_waiting", "worker_kv_blocks_active",
}  # fmt: skip


def test_bench_soak_flags_the_leak_switch_and_ends_clean(model_dir: Path, tmp_path: Path) -> None:
    out, plot, logs = tmp_path / "soak.json", tmp_path / "soak.png", tmp_path / "logs"
    args = [
        *("bench", "soak", "--model", str(model_dir), "--duration", "90", "--warmup", "30"),
        *("--rate", "2", "--sample-s", "3", "--max-tokens", "12", "--leak-kb", "64"),
        # A shared 2-core machine can stall one step past the 2 s default: what this checks is leaks and a
        # clean end, so a starved step is not a server error here (the real soak keeps the default).
        *("--step-timeout-ms", "20000"),
        *("--json", str(out), "--plot", str(plot), "--logs", str(logs)),
    ]
    done = run_kvrelay(args, timeout_s=400)
    assert done.returncode in (0, 1) and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    verdict = result["verdict"]
    assert ("verdict: PASS" in done.stdout) == verdict["ok"] == (done.returncode == 0)
    checks = {k: v for k, v in verdict["checks"].items() if k != "processes_flat"}
    assert all(checks.values()) and checks["leak_flagged"] is True, done.stdout
    leaky = verdict["processes"]["codec-leaky"]
    assert leaky["rss_growing"] is True and leaky["rss_slope_mb_per_10_min"] > leaky["rss_bar_mb_per_10_min"]
    assert set(verdict["processes"]) == {"codec", "codec-leaky", "router", "worker-0"}
    end = verdict["end_state"]
    assert {k: end[k] for k in END_STATE_KEYS} == dict.fromkeys(END_STATE_KEYS, 0)
    leaky_end = {k: v for k, v in end.items() if k.startswith("codec-leaky_")}
    assert {k.removeprefix("codec-leaky_") for k in leaky_end} >= {"codec_running", "quota_open_reservations"}
    assert set(leaky_end.values()) == {0}, leaky_end
    assert verdict["restarts"] == dict.fromkeys(verdict["processes"], 0)
    traffic = result["traffic"]
    assert traffic["server_error"] == 0 and traffic["client_error"] == 0, traffic["errors"]
    assert traffic["cancelled"] >= 0.1 * traffic["total"] > 0
    assert {"chat-tools", "anthropic-tools", "chat-structured", "responses-structured"} <= set(
        traffic["by_kind"]
    )
    assert len(result["series"]["t_s"]) >= 20 and plot.stat().st_size > 0
    assert "request's state is kept forever" in (logs / "codec-leaky.log").read_text()
    assert "request's state is kept forever" not in (logs / "codec.log").read_text()
    assert no_process_holds_open(logs)
