"""`kvrelay bench transfer` end to end on a tiny random-weight model: real worker and router processes,
small prompts, one repeat, a short load phase. Checks the JSON's shape and that KV really travelled over
gRPC and over the torch.distributed transport (gloo, which every CPU build of torch has); no timing is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import cast

from services.cli.bench_transfer import _transfer_entry
from services.cli.bench_transfer_client import Timing
from services.cli.bench_transfer_stack import Child, Stack
from tests.tiny_model import make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
TRANSFER_KEYS = {
    "kv_bytes",
    "kv_bytes_per_token",
    "kv_transfer_s",
    "ttft_s",
    "time_to_second_token_s",
    "gap_first_to_second_s",
    "inter_token_s",
    "transfer_share_of_second_token",
    "transfer_share_of_ttft",
    "prefill_modes",
    "runs",
}


def test_bench_transfer_reports_remote_kv_bytes_and_load_ttft(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "transfer.json"
    args = [
        *("bench", "transfer", "--model", str(model), "--prompt-lengths", "64,128"),
        *("--transports", "grpc,torch", "--repeats", "1", "--kv-cache-mb", "16"),
        *("--load-seconds", "2", "--short-tokens", "16", "--long-tokens", "128", "--local-below", "32"),
        *("--short-interval", "0.25", "--json", str(out), "--plot", str(tmp_path / "transfer.png")),
        *("--logs", str(tmp_path / "logs")),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "xfer/TTFT" in done.stdout and "TTFT p99 ms" in done.stdout
    result = json.loads(out.read_text())

    for transport in ("grpc", "torch"):  # torch.distributed (gloo) runs on any CPU: no skip is accepted
        side = result["transfer"][transport]
        assert side["status"] == "ok", f"{transport}: {side}"
        for length in ("64", "128"):
            summary = side["lengths"][length]
            assert summary.keys() >= TRANSFER_KEYS
            assert summary["prefill_modes"] == ["REMOTE"], f"{transport} fell back: {summary}"
            assert summary["kv_bytes"] > 0 and summary["kv_transfer_s"] > 0
            assert all(run["kv_bytes"] > 0 and run["tokens"] == 8 for run in summary["runs"])
        per_token = side["lengths"]["64"]["kv_bytes_per_token"]
        assert per_token == 2 * 2 * 2 * 16 * 4  # layers x K,V x KV heads x head dim x float32

    assert set(result["colocated"]) == {"64", "128"}
    sides = result["load"]["sides"]
    assert "colocated" in sides and "disaggregated, all on P (grpc)" in sides
    for load in sides.values():
        assert load["short"]["count"] > 0 and load["long"]["count"] > 0 and not load["errors"]
    assert (tmp_path / "transfer.png").stat().st_size > 0
    assert _no_child_left(tmp_path / "logs")


def _no_child_left(logs: Path) -> bool:
    """Every child process of the run is gone: none still has its log file open."""
    logs = logs.resolve()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            targets = [str(p.readlink()) for p in fd_dir.iterdir()]
        except OSError:
            continue
        if any(t.startswith(str(logs)) for t in targets):
            return False
    return True


def test_a_transport_that_falls_back_is_reported_as_skipped_with_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    line = {"msg": "remote prefill failed; recomputing here", "reason": "transport 'torch' is not offered"}
    log.write_text(json.dumps(line) + "\n")
    decode = Child("decode", "127.0.0.1:1", cast(subprocess.Popen[bytes], None), log)
    timing = Timing(64, 8, 0.1, 0.2, 0.01, 0.3, "FALLBACK", 0, 0.0, 0)
    entry = _transfer_entry({64: [timing]}, Stack({}, {"decode": decode}))
    assert entry["status"] == "skipped"
    assert "FALLBACK" in entry["reason"] and "not offered" in entry["reason"]
