"""`kvrelay bench admission` end to end on the real model, at tiny sizes: a stack with two tenants' keys,
the flooder at five times a 4 requests/minute quota. The flooder is refused with 429s and a Retry-After,
the other tenant gets no error, the stack ends idle, the JSON holds every section, and no process
outlives the run. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_helpers import no_process_holds_open, run_kvrelay

pytestmark = pytest.mark.model

SETTLED_KEYS = {
    "codec_running", "codec_queued", "quota_open_reservations", "quota_reserved_tokens",
    "codec_client_connections", "worker_running", "worker_waiting", "worker_kv_blocks_active",
}  # fmt: skip


def test_bench_admission_refuses_the_flooder_and_serves_the_other_tenant(
    model_dir: Path, tmp_path: Path
) -> None:
    out, logs = tmp_path / "admission.json", tmp_path / "logs"
    args = [
        *("bench", "admission", "--model", str(model_dir), "--quota-rpm", "4", "--flood-factor", "5"),
        *("--flood-seconds", "3", "--probes", "3", "--max-tokens", "4"),
        *("--json", str(out), "--logs", str(logs)),
    ]
    done = run_kvrelay(args, timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result
    assert result["ok"] is True
    flooder = result["flooder"]
    assert flooder["sent"] == 20 and sum(flooder["statuses"].values()) == 20
    assert flooder["statuses"].get("429", 0) > 0 and flooder["retry_after_s_min_max"][0] > 0
    for phase in ("unloaded", "loaded"):
        probes = result[phase]
        assert probes["requests"] == 3 and probes["errors"] == []
        assert 0 < probes["ttft_p50_ms"] <= probes["ttft_p99_ms"]
    state = result["end_state"]
    assert {k: state[k] for k in SETTLED_KEYS} == dict.fromkeys(SETTLED_KEYS, 0)
    assert result["config"]["flood_requests"] == 20 and result["config"]["quota_rpm"] == 4
    assert {p.name for p in logs.glob("*.log")} == {"worker-0.log", "router.log", "codec.log"}
    assert no_process_holds_open(logs)
