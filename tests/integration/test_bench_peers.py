"""`kvrelay bench peers` end to end on the real model, at tiny sizes: our colocated stack and
`transformers serve`, one after the other, two Q&A requests each, then the comparison. Checks each
server's result and the comparison's files; no timing is asserted. (llama.cpp is not built here: the
first build takes many minutes.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_helpers import run_kvrelay

pytestmark = pytest.mark.model

WORKLOAD = (
    "--workload qa --protocol openai-chat --arrival closed --concurrency 1 --num-requests 2 "
    "--max-tokens 4 --duration 60 --drain 30 --no-progress"
)


def test_bench_peers_measures_each_server_and_compares_them(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "peers"
    args = [
        *("bench", "peers", "--peers", "kvrelay,transformers", "--mode", "colocated"),
        *("--model", str(model_dir), "--bench-args", WORKLOAD, "--out", str(out)),
    ]
    done = run_kvrelay(args, timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("kvrelay", "transformers"):
        result = json.loads((out / f"{name}.json").read_text())
        assert result["label"] == name
        [run] = result["runs"]
        assert run["summary"]["completed"] == 2 and run["summary"]["errors"] == 0, run["summary"]
        assert (out / f"{name}.png").stat().st_size > 0
        assert "TTFT p50/p90/p99 ms" in (out / f"{name}.txt").read_text()
    assert (out / "kvrelay" / "router.log").exists() and (out / "transformers.log").exists()
    table = json.loads((out / "compare.json").read_text())
    assert table["reference"] == "kvrelay" and table["peers"] == ["transformers"]
    completed = next(row for row in table["rows"] if row["metric"] == "completed")
    assert completed["values"] == {"kvrelay": 2.0, "transformers": 2.0}
    assert "| kvrelay ÷ transformers |" in (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 0
