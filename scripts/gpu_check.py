"""kvrelay's engine on a GPU: correctness against transformers and speed, stage by stage, JSON into --out.

    python3 scripts/gpu_check.py --out "$OUT"            # on the GPU machine (every stage)
    .venv/bin/python scripts/gpu_check.py --device cpu --stages 0,9 --ipc-mib 4 --out /tmp/gpu-check  # CPU

Written for a GPU machine that has python3 with torch 2.11, triton and transformers, and no network and
no model files: every model here is built with random weights on the device and handed to the engine as
a state dict (services/engine/loader.py `load_state_dict`), never through disk. What else kvrelay's CUDA
path imports travels as wheels in `.whl` (the machine lacks them), installed with `--no-deps` into a
target directory put on PYTHONPATH:

    pydantic pydantic-core annotated-types typing-inspection (services/common/config.py)

(pyyaml, numpy, safetensors, grpcio, protobuf and prometheus-client are on the machine already; gguf and
opentelemetry are not imported on this path.) Code on the CUDA path uses only torch APIs of torch 2.11.

Stages (each writes `stage<N>_<name>.json` into --out as soon as it ends, so a stage that runs out of time
leaves the earlier ones; `summary.json` collects them):

  0 smoke       imports every CUDA-path module, runs a 2-layer random model for 8 tokens (< 30 s)
  1 copy        device copy bandwidth (a 1 GiB `copy_`), the roofline the decode figures are read against
  2 identity    greedy tokens of the engine against transformers for 64 tokens, fp32, initializer range
                0.2, TF32 off, on a 4-layer Llama-3.2-1B-like shape (full width, fewer layers); and the
                plain loop (no overlap) must give the overlapped engine's tokens
  3 cosine      bf16 last-position logits cosine against transformers (1B shape, 4 prompts)
  4 speed       per shape (llama-1b, llama-8b, bf16, random weights): decode tok/s at batch 1, 8 and 64,
                TTFT of a 2,048-token prompt, host milliseconds per decode step
  5 baseline    transformers `generate` (eager, bf16) on the same GPU and shapes, batch 1 and 64
  6 kernels     the Triton kernels (services/engine/ops/triton) against the float64 reference at real
                shapes (8B decode and mixed steps, split-KV, Gemma 3 window over head size 256, GQA 7):
                bf16 max-abs error <= 2e-2; the torch-native path's error beside it
  7 attention   paged-decode microbenchmark (batch 64, 4k context, 8 KV heads, head size 128, bf16):
                the kernel's KV read rate as a share of the copy bandwidth measured in the same stage,
                against torch-native attention; the figure it is built for is >= 60%

  8 graphs      a decode step of 5 rows through the 8-row bucket's CUDA graph, bit for bit against the
                same bucket's forward run eagerly; capture time and graph memory
  9 ipc         a 256 MiB (--ipc-mib) CUDA IPC transfer between two processes on one GPU through
                services/kvtransfer/ipc_transport.py: this process fills and `share`s a buffer, a fresh
                interpreter `open_shared`s it and copies it out; device checksums and IPC domains equal on
                both sides; the copy's GB/s (best and median of 5) as a share of a same-process `copy_`
                (< 40 s, mostly the child's CUDA start)
 10 nccl        two ranks on cuda:0 each try `init_process_group("nccl")` and one all_reduce, bounded by
                20 s: each rank's exception type and first message lines (NCCL refuses two ranks on one
                GPU: ncclInvalidUsage, "Duplicate GPU detected"), or that it succeeded; gloo on a CPU
 11 cancel      a storm of 64 long requests stepped a few times and aborted: every KV block back in the
                pool and torch.cuda.memory_allocated back to its level after a warm-up (within 2 KiB:
                the runner's last picks; see `stage_cancel`)

Stage 4 runs each shape once per `--attentions` entry (triton and torch: the engine with our kernels
against torch-native attention), with steps overlapped and decode graphs on (the GPU defaults), and
once more for the first entry without overlap (`/no_overlap`, decode at batch 1 and 64) and without
graphs (`/no_graphs`, decode at batch 1, 8 and 64). Stages 9 and 10 start fresh interpreters (never a
fork) that import this file, for its sys.path, and call a function of gpu_check_transfer.py by name
(`child_command`). Default order 0,1,9,10,6,7,8,11,2,3,4,5: the cheap stages first.

This file holds the arguments, the stage table and the loop; the stages live beside it, imported by module
name (scripts/ is sys.path[0] when this runs as a script): gpu_check_model.py (the shapes, model builders
and stages 0 to 5 and 8), gpu_check_kernels.py (6, 7) and gpu_check_transfer.py (9 to 11). This file puts
the repository root on sys.path before importing them; they import `services` inside their functions.

Under 7 minutes on one H200. Exit status 0 when every stage that ran passed its checks (`ok` in its JSON),
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
from gpu_check_transfer import stage_cancel, stage_ipc, stage_nccl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the per-stage JSON files")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    p.add_argument("--stages", default="0,1,9,10,6,7,8,11,2,3,4,5", help="comma-separated stage numbers")
    p.add_argument("--attentions", default="triton,torch", help="engine.attention values stage 4 compares")
    p.add_argument("--shapes", default="llama-1b,llama-8b", help="shapes for stages 4 and 5")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per batch size")
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
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for number in (int(s) for s in args.stages.split(",")):
        name, run = STAGES[number]
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
        summary[f"{number}_{name}"] = result
        (args.out / f"stage{number}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(
            json.dumps({f"{number}_{name}": {k: v for k, v in result.items() if k != "traceback"}}),
            flush=True,
        )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(r.get("ok") for r in summary.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
