"""kvrelay's engine on a GPU: correctness against transformers and speed, stage by stage, results into --out.

    timeout 360 python3 scripts/gpu_check.py --out "$OUT"   # on the GPU machine (every stage, < 6 min)
    .venv/bin/python scripts/gpu_check.py --device cpu --check-shape tiny --shapes tiny --copy-mib 8 \
        --ipc-mib 4 --decode-steps 4 --attentions auto --out /tmp/gpu-check      # a CPU dry run

Written for the device machine as its README describes it: Python 3.12 with torch, triton and transformers,
no network and no model files. Every model here is built with random weights on the device and handed to
the engine as a state dict (engine/loading/loader.py `load_state_dict`), never through disk. What else
kvrelay's CUDA path imports travels as wheels in `.whl`, computed from an import trace of the CPU dry run,
not kept by hand (scripts/gpu_check_wheels.py; `--download .whl` fetches them), and installed with
`--no-deps` into a target directory put first on PYTHONPATH. Optional packages (llguidance, gguf,
opentelemetry) are never imported on this path; CI runs the dry run with every package the device lacks
blocked from import.

The device returns at most 8 files, so `--out` gets three: `probe.json` (written first: Python, the
packages' versions, the GPU, and whether the generated protobuf and gRPC modules import), `summary.json`
and `gpu_check.tar.gz` (every stage's JSON and the probe), both rewritten as each stage ends, so a check
cut off by its `timeout` still returns the stages before. Stage files are written into `--work` (outside
`--out`). Memory is released between stages (gc, the allocator's cache, its peak), and each stage's JSON
records what this process still held after the one before. A stage that would start past `--budget-s` is
skipped, not begun. `--stages` reruns a subset.

Stages, in the default order (most value first; cheap ones early):

  0 smoke       imports every CUDA-path module, runs a 2-layer random model for 8 tokens (< 30 s)
  1 copy        device copy bandwidth (a 1 GiB `copy_`), the roofline the decode figures are read against
  2 identity    greedy tokens of the engine against transformers for 64 tokens, fp32, initializer range
                0.2, TF32 off, on a 4-layer Llama-3.2-1B-like shape (full width, fewer layers); and the
                plain loop (no overlap) must give the overlapped engine's tokens
  4 speed       per shape (llama-1b, llama-8b, bf16, random weights): decode tok/s at batch 1, 8 and 64,
                TTFT of a 2,048-token prompt, host milliseconds per decode step
  6 kernels     the Triton kernels (services/engine/ops/triton) against the float64 reference at real
                shapes (8B decode and mixed steps, split-KV, Gemma 3 window over head size 256, GQA 7):
                bf16 max-abs error <= 2e-2; the torch-native path's error beside it
  7 attention   paged-decode microbenchmark (batch 64, 4k context, 8 KV heads, head size 128, bf16):
                the kernel's KV read rate as a share of the copy bandwidth measured in the same stage,
                against torch-native attention; the figure it is built for is >= 60%
  8 graphs      a decode step of 5 rows through the 8-row bucket's CUDA graph, bit for bit against the
                same bucket's forward run eagerly; capture time and graph memory
  3 cosine      bf16 last-position logits cosine against transformers (1B shape, 4 prompts)
 11 cancel      a storm of 64 long requests stepped a few times and aborted: every KV block back in the
                pool and torch.cuda.memory_allocated back to its level after a warm-up (within 2 KiB:
                the runner's last picks; see `stage_cancel`)
  12 tiers       the host KV tier below the device pool: a prompt's four 64-token segments written through to
                host memory, the pool emptied, the same prompt again loading them: the fp32 greedy tokens
                equal the cold answer's, 256 cached tokens; the fetch rate (< 30 s)
  13 t5         an encoder-decoder model (tiny random T5, gated GELU) served by the engine on the device and
                on the CPU from one state dict: six batched sources of 1 to 90 tokens, 16 greedy fp32 tokens
                each, equal up to a near-tie (top-2 margin under 1e-3), every block back (< 30 s;
                scripts/gpu_check_t5.py)
  9 ipc         a 256 MiB (--ipc-mib) CUDA IPC transfer between two processes on one GPU through
                services/kvtransfer/ipc_transport.py: this process fills and `share`s a buffer, a fresh
                interpreter `open_shared`s it and copies it out; device checksums and IPC domains equal on
                both sides; the copy's GB/s (best and median of 5) as a share of a same-process `copy_`
 10 nccl        two ranks on cuda:0 each try `init_process_group("nccl")` and one all_reduce, bounded by
                20 s: each rank's exception type and first message lines (NCCL refuses two ranks on one
                GPU: ncclInvalidUsage, "Duplicate GPU detected"), or that it succeeded; gloo on a CPU
  5 baseline    transformers `generate` (eager, bf16) on the same GPU and shapes, batch 1 and 64

Stage 4 runs each shape once per `--attentions` entry (triton and torch: the engine with our kernels
against torch-native attention), with steps overlapped and decode graphs on (the GPU defaults), and
once more for the first entry without overlap (`/no_overlap`, decode at batch 1 and 64) and without
graphs (`/no_graphs`, decode at batch 1, 8 and 64). Stages 9 and 10 start fresh interpreters (never a
fork) that import this file, for its sys.path, and call a function of gpu_check_transfer.py by name
(`child_command`).

This file holds the arguments, the stage table and the loop; the stages live beside it, imported by module
name (scripts/ is sys.path[0] when this runs as a script): gpu_check_model.py (the shapes, model builders
and stages 0 to 5 and 8), gpu_check_kernels.py (6, 7) and gpu_check_transfer.py (9 to 12). This file puts
the repository root on sys.path before importing them; they import `services` inside their functions.

Exit status 0 when every stage that ran passed its checks (`ok` in its JSON), 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_check_wheels
from gpu_check_kernels import stage_attention, stage_kernels
from gpu_check_model import (
    stage_baseline,
    stage_copy,
    stage_cosine,
    stage_graphs,
    stage_identity,
    stage_smoke,
    stage_speed,
)
from gpu_check_t5 import stage_t5
from gpu_check_transfer import stage_cancel, stage_ipc, stage_nccl, stage_tiers

gpu_check_wheels.register_trace()  # a no-op unless KVRELAY_IMPORT_TRACE is set (children too)

DEFAULT_STAGES = "0,1,2,4,6,7,8,3,11,12,13,9,10,5"
PROBED = ("torch", "triton", "transformers", "numpy", "protobuf", "grpcio", "pydantic", "pydantic-core",
          "safetensors", "pyyaml", "prometheus-client", "llguidance")  # fmt: skip
BUNDLE = "gpu_check.tar.gz"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="probe.json, summary.json, the bundle")
    p.add_argument("--work", type=Path, help="folder for the per-stage JSON files (default: a temp dir)")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    p.add_argument("--stages", default=DEFAULT_STAGES, help="comma-separated stage numbers, run in order")
    p.add_argument("--budget-s", type=float, default=330.0, help="no stage starts after this many seconds")
    p.add_argument("--attentions", default="triton,torch", help="engine.attention values stage 4 compares")
    p.add_argument("--shapes", default="llama-1b,llama-8b", help="shapes for stages 4 and 5")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per batch size")
    p.add_argument("--identity-tokens", type=int, default=64, help="greedy tokens stage 2 compares")
    p.add_argument("--check-shape", default="llama-1b", help="shape of stages 2 and 3 (tiny: a CPU dry run)")
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes copied by stage 1, in MiB")
    p.add_argument("--ipc-mib", type=int, default=256, help="bytes stage 9 moves between processes, in MiB")
    return p.parse_args(argv)


STAGES: dict[int, tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = {
    0: ("smoke", stage_smoke),
    1: ("copy", stage_copy),
    2: ("identity", stage_identity),
    3: ("cosine", stage_cosine),
    4: ("speed", stage_speed),
    5: ("baseline", stage_baseline),
    6: ("kernels", stage_kernels),
    7: ("attention", stage_attention),
    8: ("graphs", stage_graphs),
    9: ("ipc", stage_ipc),
    10: ("nccl", stage_nccl),
    11: ("cancel", stage_cancel),
    12: ("tiers", stage_tiers),
    13: ("t5", stage_t5),
}


def probe(device: str) -> dict[str, Any]:
    """What the machine has, before any stage: versions, the GPU, and whether the generated modules import
    (they refuse a protobuf or grpcio older than the one that generated them)."""
    versions: dict[str, str | None] = {}
    for name in PROBED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    result: dict[str, Any] = {
        "python": platform.python_version(), "machine": platform.machine(), "versions": versions,
        "generated_code_needs": gpu_check_wheels.generated_code_needs(),
    }  # fmt: skip
    optional = ("llguidance", "gguf", "opentelemetry")
    result["optional_importable"] = {name: _importable(name) for name in optional}
    for module in ("services.proto_gen.kvrelay.v1.worker_pb2_grpc", "services.common.config"):
        try:
            importlib.import_module(module)
            result[f"imports_{module.rsplit('.', 1)[-1]}"] = True
        except Exception as exc:  # reported, not fatal: the stages that need it fail with it
            result[f"imports_{module.rsplit('.', 1)[-1]}"] = f"{type(exc).__name__}: {exc}"[:500]
    import torch

    result["cuda"] = torch.version.cuda
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "multiprocessors": props.multi_processor_count,
                         "capability": f"{props.major}.{props.minor}"}  # fmt: skip
    return result


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def release_memory(device: str) -> dict[str, Any]:
    """Drop what the last stage left (cycles, the allocator's cache, its peak); what this process still
    holds afterwards, so a stage that leaks shows up in the next one's JSON."""
    gc.collect()
    import torch

    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_mib_before": round(torch.cuda.memory_allocated() / 2**20, 1),
        "reserved_mib_before": round(torch.cuda.memory_reserved() / 2**20, 1),
        "free_gib_before": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2),
    }  # fmt: skip


def run_stage(number: int, args: argparse.Namespace) -> dict[str, Any]:
    run = STAGES[number][1]
    memory = release_memory(args.device)
    started = time.perf_counter()
    try:
        result = run(args)
    except Exception as exc:  # a stage's failure is its result; the next stage still runs
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }
    result["stage_seconds"] = round(time.perf_counter() - started, 1)
    if memory:
        result["memory"] = memory
    return result


def write_results(out: Path, work: Path, summary: dict[str, Any]) -> None:
    """summary.json and the bundle of every file in `work`, each replaced whole (never half written)."""
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    partial = out / "summary.json.part"
    partial.write_text(json.dumps(summary, indent=2) + "\n")
    partial.replace(out / "summary.json")
    bundle = out / (BUNDLE + ".part")
    with tarfile.open(bundle, "w:gz") as tar:
        for path in sorted(work.glob("*.json")):
            tar.add(path, arcname=f"gpu_check/{path.name}")
    bundle.replace(out / BUNDLE)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    probed = probe(args.device)
    for folder in (args.out, work):
        (folder / "probe.json").write_text(json.dumps(probed, indent=2) + "\n")
    print(json.dumps({"probe": probed}), flush=True)
    summary: dict[str, Any] = {}
    for number in (int(s) for s in args.stages.split(",")):
        name = STAGES[number][0]
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            result: dict[str, Any] = {"ok": None, "skipped": f"past the {args.budget_s:.0f} s budget"}
        else:
            result = run_stage(number, args)
        summary[f"{number}_{name}"] = result
        (work / f"stage{number}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        write_results(args.out, work, summary)
        print(
            json.dumps({f"{number}_{name}": {k: v for k, v in result.items() if k != "traceback"}}),
            flush=True,
        )
    ran = [r for r in summary.values() if "skipped" not in r]
    return 0 if all(r.get("ok") for r in ran) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
