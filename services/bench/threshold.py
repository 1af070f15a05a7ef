"""`kvrelay bench threshold`: where gguf-hybrid's small steps should end on this CPU, measured.

Loads the model once with `model.weights: gguf-hybrid` and times one decode step of M sequences (each one
token at `--context` tokens of context, every layer and the LM head) through each of the two paths: the C
kernels over the GGUF blocks, and the GEMMs over the copy unpacked at load. Both paths take turns within
each of `--rounds` rounds, at every M and thread count, so a VM's drift hits them alike; each time is the
median over rounds of the best of `--repeats` calls. A thread count's threshold is the largest M at which
the kernels were faster such that the GEMM won at every larger M measured (the largest M measured when
the kernels never lost). `--write` puts the thresholds into the table the engine ships
(services/engine/ops/step_thresholds.json) under this CPU's class; `--json` and `--plot` keep the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from services.bench.stats import median

DEFAULT_TOKENS = "1,2,4,8,12,16,24,32,48,64,96,128,192,256"  # 256: a CPU step's default token budget
PATHS = {"kernels": 1 << 30, "gemm": 0}  # each path forced through small_step_max_tokens


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("threshold", help="where gguf-hybrid switches from the GGUF blocks to the GEMM")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated step sizes M (sequences)")
    p.add_argument("--context", type=int, default=128, help="tokens of context each sequence attends over")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="calls per path, M and round (the best counts)")
    p.add_argument("--write", action="store_true", help="put the thresholds into the shipped table")
    p.add_argument("--table", type=Path, default=None, help="the table to write (default: the shipped one)")
    p.add_argument("--json", type=Path, default=None, help="write the run as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of time per token here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from services.engine.ops import step_threshold
    from services.engine.ops.cpu_features import cpu_flags

    threads = [int(t) for t in args.threads.split(",")]
    tokens = sorted(int(m) for m in args.tokens.split(","))
    model, caches = _load(args.model, max(tokens), args.context)
    block_size = 16
    times: dict[str, dict[str, dict[str, list[float]]]] = {}
    for num_threads in threads:
        torch.set_num_threads(num_threads)
        per_path: dict[str, dict[str, list[float]]] = {path: {str(m): [] for m in tokens} for path in PATHS}
        for round_index in range(args.rounds):
            for m in tokens:
                order = list(PATHS) if round_index % 2 == 0 else list(reversed(PATHS))
                for path in order:
                    model.small_step_max_tokens = PATHS[path]
                    best = _time_step(model, caches, m, args.context, block_size, args.repeats)
                    per_path[path][str(m)].append(best)
        times[str(num_threads)] = per_path
    flags = cpu_flags()
    result: dict[str, Any] = {
        "cpu": step_threshold.cpu_class(flags),
        "cpu_model": cpu_model_name(),
        "context": args.context,
        "rounds": args.rounds,
        "tokens": tokens,
        "threads": {},
    }
    for thread_key, per_path in times.items():
        medians = {path: {size: median(v) for size, v in values.items()} for path, values in per_path.items()}
        result["threads"][thread_key] = {
            "ms": medians,
            "small_step_max_tokens": choose(tokens, medians["kernels"], medians["gemm"]),
        }
    print(format_result(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_threshold(result, args.plot)
    if args.write:
        table = args.table or step_threshold.TABLE
        write_table(table, result, recorded_command(sys.argv[sys.argv.index("threshold") :]))
        print(f"wrote {table}")
    return 0


def choose(tokens: list[int], kernels: dict[str, float], gemm: dict[str, float]) -> int:
    """The largest M at which the kernels won (so the GEMM won every larger M measured); 1 if they won none
    (a one-token step keeps the kernels' path whatever the table says)."""
    return max((m for m in tokens if kernels[str(m)] <= gemm[str(m)]), default=1)


def recorded_command(argv: list[str]) -> str:
    """The command as the table records it: what was measured, not where its outputs went."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--json", "--plot", "--table"):
            skip = True
        elif arg != "--write" and not arg.startswith(("--json=", "--plot=", "--table=")):
            kept.append(arg)
    return " ".join(["kvrelay", "bench", *kept])


def write_table(path: Path, result: dict[str, Any], command: str) -> None:
    """Replace (or add) this CPU class's entries for the measured thread counts."""
    document = json.loads(path.read_text()) if path.is_file() else {"entries": []}
    measured = {int(t) for t in result["threads"]}
    kept = [e for e in document["entries"] if not (e["cpu"] == result["cpu"] and e["threads"] in measured)]
    today = datetime.date.today().isoformat()
    for num_threads, entry in result["threads"].items():
        kept.append(
            {
                "cpu": result["cpu"],
                "threads": int(num_threads),
                "small_step_max_tokens": entry["small_step_max_tokens"],
                "measured_on": f"{result['cpu_model']}, {today}",
                "command": command,
            }
        )
    document["entries"] = sorted(kept, key=lambda e: (e["cpu"], e["threads"]))
    path.write_text(json.dumps(document, indent=2) + "\n")


def format_result(result: dict[str, Any]) -> str:
    lines = [f"CPU class {result['cpu']} ({result['cpu_model']}), context {result['context']}"]
    for num_threads, entry in result["threads"].items():
        lines.append(f"{num_threads} threads: small_step_max_tokens {entry['small_step_max_tokens']}")
        lines.append("  M      kernels ms   gemm ms   kernels/gemm")
        for m in result["tokens"]:
            k, g = entry["ms"]["kernels"][str(m)], entry["ms"]["gemm"][str(m)]
            lines.append(f"  {m:<6} {k:>10.2f} {g:>9.2f}   {k / g:>8.2f}")
    return "\n".join(lines)


def plot_threshold(result: dict[str, Any], path: Path) -> None:
    from services.bench.plots import line_chart

    series = {
        f"{path_name}, {t} threads": [entry["ms"][path_name][str(m)] / m for m in result["tokens"]]
        for t, entry in result["threads"].items()
        for path_name in PATHS
    }
    title = f"gguf-hybrid step paths on {result['cpu_model']} ({result['cpu']})"
    line_chart(result["tokens"], series, "tokens in the step (decode sequences)", "ms per token", title, path)


def cpu_model_name() -> str:
    """The CPU's model name with its family and model numbers, from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return "unknown CPU"
    name = fields.get("model name", "unknown CPU")
    held = os.environ.get("ONEDNN_MAX_CPU_ISA")  # scripts/hold_to_avx2.sh
    if held:
        name += f" held to {held}"
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def _load(model_dir: str, max_tokens: int, context: int) -> tuple[Any, list[Any]]:
    import torch

    from services.engine.loading.loader import load_model

    loaded = load_model(model_dir, "auto", weights="gguf-hybrid", small_step_max_tokens=1)
    model = loaded.model
    cfg = loaded.config
    slots = max_tokens * (-(-(context + 1) // 16)) * 16
    shape = (slots, 2, cfg.num_kv_heads, cfg.head_dim)  # [num_slots, 2, kv_heads, head_dim]
    caches = [torch.zeros(shape, dtype=model.kv_dtype) for _ in range(cfg.num_layers)]
    return model, caches


def _time_step(model: Any, caches: list[Any], m: int, context: int, block_size: int, repeats: int) -> float:
    """The best of `repeats` calls of one decode step of m sequences, in ms."""
    import torch

    from services.engine.layers.attention_metadata import RowSpec, build_metadata

    blocks_per_row = -(-(context + 1) // block_size)
    rows = [RowSpec(list(range(i * blocks_per_row, (i + 1) * blocks_per_row)), context, 1) for i in range(m)]
    meta = build_metadata(rows, [], block_size)
    token_ids = torch.arange(100, 100 + m)  # [m]
    last = torch.arange(m)  # [m]: every sequence's logits
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model.forward(token_ids, caches, meta, last)
        best = min(best, time.perf_counter() - start)
    return best * 1000
