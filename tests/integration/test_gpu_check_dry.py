"""scripts/gpu_check.py on the CPU: its help, and a dry run of its stages on the tiny shape, so the script a
GPU machine runs is known to start, build models from state dicts and write its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.stack_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"


def test_help_lists_the_stages() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--stages" in done.stdout and "--device" in done.stdout


def test_a_dry_run_on_the_cpu_writes_every_stage(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(SCRIPT), "--device", "cpu", "--stages", "0,1,3,4,5,6,7,8",
        "--check-shape", "tiny", "--shapes", "tiny", "--copy-mib", "8", "--decode-steps", "4",
        "--attentions", "auto", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, (summary, done.stderr[-2000:])
    stages = [
        "0_smoke",
        "1_copy",
        "3_cosine",
        "4_speed",
        "5_baseline",
        "6_kernels",
        "7_attention",
        "8_graphs",
    ]
    assert set(summary) == set(stages)
    assert summary["8_graphs"]["bucket"] == 8 and summary["8_graphs"]["bit_identical"]
    smoke = json.loads((tmp_path / "stage0_smoke.json").read_text())
    assert smoke["ok"] and smoke["device"] == "cpu" and smoke["tokens"] == smoke["transformers_tokens"]
    assert min(summary["3_cosine"]["cosines"]) >= 0.999
    speed = summary["4_speed"]["tiny"]
    assert all(speed[f"decode_tok_s_b{b}"] > 0 for b in (1, 8, 64))
    assert summary["4_speed"]["tiny/no_overlap"]["decode_tok_s_b64"] > 0
    kernels = summary["6_kernels"]  # under the interpreter (TRITON_INTERPRET=1 from conftest.py)
    assert kernels["ok"] and kernels["llama1b_split_decode"]["split_kv"] is False  # shrunk: too short
    assert all(kernels[case]["max_abs_error"] <= 2e-2 for case in kernels if isinstance(kernels[case], dict))
    attention = summary["7_attention"]
    assert attention["b64_auto"]["triton_us"] > 0 and attention["b64_split"]["torch_native_us"] > 0
