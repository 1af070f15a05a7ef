"""`kvrelay bench async-lane` end to end on the real model, at tiny sizes: one round of both phases on a
stack that drains a queue-role Redis of its own. Checks the JSON's shape, that every interactive request
was served, that background work ran beside the second phase and none in the first, the PNG, and that no
process outlived the run; with `--batch-lines`, that the batch (in a PostgreSQL database of the test's
own) completed after the load stopped. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench_helpers import no_process_holds_open, run_kvrelay
from tests.postgres import fresh_database

pytestmark = pytest.mark.model


@pytest.mark.parametrize("batch_lines", [0, 4])
def test_bench_async_lane_measures_both_phases_of_a_round(
    model_dir: Path, tmp_path: Path, batch_lines: int
) -> None:
    out, png, logs = tmp_path / "async.json", tmp_path / "async.png", tmp_path / "logs"
    with fresh_database() as database:
        batch = ["--batch-lines", str(batch_lines), "--batch-max-tokens", "4", "--batch-store-url", database]
        result, stdout = _bench(model_dir, out, png, logs, batch)
    assert "TTFT p50 ratio background/alone" in stdout
    assert result["saturation_rps"] > 0 and result["interactive_rps"] == result["saturation_rps"] / 2
    [phases] = result["rounds"]
    alone, background = phases["alone"], phases["background"]
    assert alone["requests"] == alone["ok"] >= 1 and background["requests"] == background["ok"] >= 1
    assert alone["background_submitted"] == 0
    # how many finish within the phase is a measurement (0 on a loaded machine), not something to assert
    assert background["background_submitted"] >= (batch_lines or 2)
    assert 0 <= background["background_completed"] <= background["background_submitted"]
    if batch_lines:  # the batch ran to its end after the load stopped
        assert background["batch_done_after_load_s"] is not None and "batch completed" in stdout
    assert len(result["ttft_p50_ratios"]) == 1 and result["median_ttft_p50_ratio"] > 0
    assert png.stat().st_size > 0
    assert no_process_holds_open(logs)


def _bench(model_dir: Path, out: Path, png: Path, logs: Path, extra: list[str]) -> tuple[dict[str, Any], str]:
    args = [
        "bench", "async-lane", "--model", str(model_dir), "--rounds", "1", "--phase-seconds", "6",
        "--saturation-requests", "2", "--saturation-clients", "1", "--max-tokens", "4",
        "--background-max-tokens", "4", "--backlog", "2",
        "--json", str(out), "--plot", str(png), "--logs", str(logs), *extra,
    ]  # fmt: skip
    done = run_kvrelay(args, timeout_s=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout
