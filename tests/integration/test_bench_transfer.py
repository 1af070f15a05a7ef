"""`kvrelay bench transfer` end to end on a tiny random-weight model: real worker and router processes,
small prompts, one repeat, a short load phase. Checks the JSON's shape and that KV really travelled over
gRPC and over the torch.distributed transport (gloo, which every CPU build of torch has); no timing is
asserted."""

from __future__ import annotations

import json
from pathlib import Path

from services.bench.transfer.client import Timing
from services.bench.transfer.command import _transfer_entry
from services.bench.transfer.stack import Stack
from tests.bench_helpers import no_process_holds_open, run_kvrelay
from tests.tiny_model import make_tiny_llama

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
    done = run_kvrelay(args)
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
    assert no_process_holds_open(tmp_path / "logs")


def test_a_transport_that_falls_back_is_reported_as_skipped_with_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    line = {"msg": "remote prefill failed; recomputing here", "reason": "transport 'torch' is not offered"}
    log.write_text(json.dumps(line) + "\n")
    timing = Timing(64, 8, 0.1, 0.2, 0.01, 0.3, "FALLBACK", 0, 0.0, 0)
    entry = _transfer_entry({64: [timing]}, Stack({}, {"decode": log}))
    assert entry["status"] == "skipped"
    assert "FALLBACK" in entry["reason"] and "not offered" in entry["reason"]
