"""scripts/gpu_check.py on the CPU: its help, and a dry run of its stages on the tiny shape, so the script a
GPU machine runs is known to start, build models from state dicts and write its JSON. The dry run runs once
for the module; the stages that start other processes (9 ipc, 10 nccl) really do, over shared memory and
gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.stack_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"
STAGES = ["0_smoke", "1_copy", "3_cosine", "4_speed", "5_baseline", "6_kernels", "7_attention", "8_graphs",
          "9_ipc", "10_nccl", "11_cancel"]  # fmt: skip


class DryRun(NamedTuple):
    out: Path
    summary: dict[str, Any]
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    out = tmp_path_factory.mktemp("gpu-check")
    numbers = ",".join(stage.split("_")[0] for stage in STAGES)
    argv = [
        sys.executable, str(SCRIPT), "--device", "cpu", "--stages", numbers, "--check-shape", "tiny",
        "--shapes", "tiny", "--copy-mib", "8", "--ipc-mib", "4", "--decode-steps", "4",
        "--attentions", "auto", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    summary = json.loads((out / "summary.json").read_text())
    return DryRun(out, summary, done.returncode, done.stderr[-2000:])


def test_help_lists_the_stages() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--stages" in done.stdout and "--device" in done.stdout
    assert "--ipc-mib" in done.stdout


def test_a_dry_run_on_the_cpu_writes_every_stage(dry_run: DryRun) -> None:
    summary = dry_run.summary
    assert dry_run.returncode == 0, (summary, dry_run.stderr)
    assert set(summary) == set(STAGES)
    assert all((dry_run.out / f"stage{stage}.json").exists() for stage in STAGES)
    assert summary["8_graphs"]["bucket"] == 8 and summary["8_graphs"]["bit_identical"]
    smoke = json.loads((dry_run.out / "stage0_smoke.json").read_text())
    assert smoke["ok"] and smoke["device"] == "cpu" and smoke["tokens"] == smoke["transformers_tokens"]
    assert min(summary["3_cosine"]["cosines"]) >= 0.999
    speed = summary["4_speed"]
    assert all(speed["tiny"][f"decode_tok_s_b{b}"] > 0 for b in (1, 8, 64))
    assert all(speed["tiny/no_graphs"][f"decode_tok_s_b{b}"] > 0 for b in (1, 8, 64))
    assert speed["tiny/no_overlap"]["decode_tok_s_b64"] > 0
    kernels = summary["6_kernels"]  # under the interpreter (TRITON_INTERPRET=1 from conftest.py)
    assert kernels["ok"] and kernels["llama1b_split_decode"]["split_kv"] is False  # shrunk: too short
    assert all(kernels[case]["max_abs_error"] <= 2e-2 for case in kernels if isinstance(kernels[case], dict))
    attention = summary["7_attention"]
    assert attention["b64_auto"]["triton_us"] > 0 and attention["b64_split"]["torch_native_us"] > 0


def test_the_ipc_stage_copies_a_shared_buffer_into_another_process(dry_run: DryRun) -> None:
    ipc = dry_run.summary["9_ipc"]
    assert ipc["ok"], ipc
    assert ipc["handle"] == "shm" and ipc["bytes"] == 4 * 2**20 and ipc["consumer_pid"] != ipc["pid"]
    assert ipc["checksums_equal"] and ipc["checksum"] == ipc["consumer_checksum"]
    assert ipc["domains_equal"] and ipc["domain"] == ipc["consumer_domain"]
    assert ipc["ipc"]["gb_per_s"] > 0 and ipc["copy"]["gb_per_s"] > 0 and ipc["share_of_copy"] > 0
    assert ipc["ipc"]["best_s"] <= ipc["ipc"]["median_s"]


def test_the_nccl_stage_runs_two_gloo_ranks_on_the_cpu(dry_run: DryRun) -> None:
    nccl = dry_run.summary["10_nccl"]
    assert nccl["ok"] and nccl["backend"] == "gloo" and nccl["all_succeeded"], nccl
    assert [r["rank"] for r in nccl["ranks"]] == [0, 1]
    assert all(r["all_reduce"] == 2.0 and not r["killed"] and r["returncode"] == 0 for r in nccl["ranks"])
    assert not nccl["refused"] and not nccl["duplicate_gpu_detected"]


def test_the_cancel_stage_frees_every_block_after_a_storm_on_the_cpu(dry_run: DryRun) -> None:
    cancel = dry_run.summary["11_cancel"]
    assert cancel["ok"] and cancel["all_blocks_free"] and cancel["invariant_error"] is None, cancel
    blocks = cancel["blocks"]
    assert blocks["num_free"] == blocks["num_total"] > 0 and blocks["num_active"] == 0
    assert cancel["aborted_sequences"] == 64 and cancel["running_at_abort"] > 0
    assert cancel["memory_allocated_after_cancel"] is None  # a CPU checks the blocks only
