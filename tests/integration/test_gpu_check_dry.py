"""scripts/gpu_check.py on the CPU: its help, and a dry run of every stage on the tiny shape, so the script a
GPU machine runs is known to start, build models from state dicts and write its results. The dry run runs
once for the module, as the device would run it: every module whose package is neither on the device's
image (scripts/gpu_device_packages.txt) nor in the committed wheel plan (scripts/gpu_check_wheels.json)
is blocked from import (tests/import_blocker), in the check and in the children of stages 9 and 10, and
the run is traced so that a stale plan fails here. The stages that start other processes (9 ipc, 10 nccl)
really do, over shared memory and gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.stack_helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_check_wheels

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"
BLOCKER = REPO_ROOT / "tests" / "import_blocker"
STAGES = ["0_smoke", "1_copy", "2_identity", "4_speed", "6_kernels", "7_attention", "8_graphs", "3_cosine",
          "11_cancel", "12_tiers", "13_t5", "9_ipc", "10_nccl", "5_baseline"]  # fmt: skip


class DryRun(NamedTuple):
    out: Path
    summary: dict[str, Any]
    returncode: int
    stderr: str
    blocked: list[str]
    traced: dict[str, str]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    out = tmp_path_factory.mktemp("gpu-check")
    blocked = gpu_check_wheels.blocked_modules(set(gpu_check_wheels.read_plan()))
    trace = out / "imports.jsonl"
    env = {
        **os.environ, "PYTHONPATH": str(BLOCKER), gpu_check_wheels.BLOCK_ENV: ",".join(blocked),
        gpu_check_wheels.TRACE_ENV: str(trace),
    }  # fmt: skip
    argv = gpu_check_wheels.dry_run_argv(out)  # every stage, in the default order
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=REPO_ROOT, env=env)
    summary = json.loads((out / "summary.json").read_text())
    traced = gpu_check_wheels.distributions(gpu_check_wheels.traced_files(trace))
    return DryRun(out, summary, done.returncode, done.stderr[-2000:], blocked, traced)


def test_help_lists_the_stages() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--stages" in done.stdout and "--device" in done.stdout
    assert "--ipc-mib" in done.stdout


def test_the_optional_packages_are_blocked_in_the_dry_run(dry_run: DryRun) -> None:
    assert {"llguidance", "gguf", "opentelemetry", "fastapi"} <= set(dry_run.blocked)
    assert not {"torch", "transformers", "pydantic", "grpc", "google"} & set(dry_run.blocked)
    env = {**os.environ, "PYTHONPATH": str(BLOCKER), gpu_check_wheels.BLOCK_ENV: "llguidance"}
    done = subprocess.run(
        [sys.executable, "-c", "import llguidance"], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0 and "blocked" in done.stderr


def test_the_committed_wheel_plan_is_what_the_dry_run_imports(dry_run: DryRun) -> None:
    plan = gpu_check_wheels.read_plan()
    assert gpu_check_wheels.wheels_to_carry(dry_run.traced) == plan, "run scripts/gpu_check_wheels.py --write"
    assert not set(gpu_check_wheels.OPTIONAL) & set(plan)
    assert {"protobuf", "grpcio", "pydantic", "pydantic-core"} <= set(plan)  # the generated code, the config


def test_a_dry_run_on_the_cpu_runs_every_stage_without_the_missing_packages(dry_run: DryRun) -> None:
    summary = dry_run.summary
    assert dry_run.returncode == 0, (summary, dry_run.stderr)
    assert list(summary) == STAGES  # the default order, most value first
    returned = sorted(p.name for p in dry_run.out.iterdir() if p.is_file())
    assert returned == ["gpu_check.tar.gz", "imports.jsonl", "probe.json", "summary.json"]
    with tarfile.open(dry_run.out / "gpu_check.tar.gz") as tar:
        bundled = {Path(name).name for name in tar.getnames()}
    assert {f"stage{stage}.json" for stage in STAGES} | {"probe.json", "summary.json"} <= bundled
    probe = json.loads((dry_run.out / "probe.json").read_text())
    assert probe["versions"]["torch"] and probe["optional_importable"]["llguidance"] is False  # blocked
    assert probe["imports_worker_pb2_grpc"] is True and probe["generated_code_needs"]["protobuf"]
    identity = summary["2_identity"]
    assert identity["ok"] and all(identity["identical"]) and identity["overlap_matches_plain"]
    assert summary["8_graphs"]["bucket"] == 8 and summary["8_graphs"]["bit_identical"]
    smoke = json.loads((dry_run.out / "work" / "stage0_smoke.json").read_text())
    assert smoke["ok"] and smoke["device"] == "cpu" and smoke["tokens"] == smoke["transformers_tokens"]
    assert min(summary["3_cosine"]["cosines"]) >= 0.999
    speed = summary["4_speed"]
    assert all(speed["tiny"][f"decode_tok_s_b{b}"] > 0 for b in (1, 8, 64))
    assert all(speed["tiny/no_graphs"][f"decode_tok_s_b{b}"] > 0 for b in (1, 8, 64))
    assert speed["tiny/no_overlap"]["decode_tok_s_b64"] > 0
    kernels = summary["6_kernels"]  # under the interpreter (TRITON_INTERPRET=1 from conftest.py)
    assert kernels["ok"] and kernels["llama1b_split_decode"]["split_kv"] is False  # shrunk: too short
    assert all(kernels[case]["max_abs_error"] <= 2e-2 for case in kernels if isinstance(kernels[case], dict))
    ratios = [case["fp32_one_key_ratio"] for case in kernels.values() if isinstance(case, dict)]
    assert len(ratios) == 5 and max(ratios) <= kernels["one_key_limit"] / 10
    tiers = summary["12_tiers"]  # the host tier below the pool: the same tokens from loaded KV
    assert (
        tiers["ok"]
        and tiers["tokens_equal"]
        and tiers["warm_cached_tokens"] == tiers["fetched_tokens"] == 256
    )
    t5 = summary["13_t5"]  # an encoder-decoder model through the engine, every step compared
    assert t5["ok"] and t5["steps_compared"] == t5["steps"] == 96 and t5["blocks_held"] == 0, t5
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
