"""`kvrelay bench engine`: our engine against transformers' bf16 `generate`, same prompts, one run.

Decode rates leave prefill out on both sides: for transformers, a no-op logits processor stamps every
step and the rate is B·(steps−1)/(t_last − t_first); for our engine, the same count over the steps after
every sequence has its first token. Prefill is one 512-token prompt (fresh random tokens each run, so
no prefix-cache hit), median of 3 after a warm-up. TTFT is the median time to the first token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in simple terms for a child who is ten years old.",
    "List three uses of Python.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes with all the steps and ingredients.",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes fly?",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="engine decode/prefill throughput against transformers generate")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-baseline", action="store_true", help="skip transformers (not a comparison)")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from services.cli.bench_engine_sides import measure_baseline, measure_kvrelay

    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.concurrency.split(",")]
    prompts = _chat_prompts(Path(args.model), max(batches))
    rng = random.Random(0)
    prefill_prompts = [[rng.randrange(100, 30000) for _ in range(args.prefill_tokens)] for _ in range(4)]
    from services.engine.loader import resolve_precision

    result: dict[str, Any] = {
        "model": str(args.model),
        "dtype": args.dtype,
        "precision": resolve_precision(args.dtype).describe(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "baseline": "transformers generate, bfloat16, sdpa",
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "prefill_tokens": args.prefill_tokens,
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    result["kvrelay"] = measure_kvrelay(args, prompts, prefill_prompts, batches)
    if not args.no_baseline:
        result["transformers"] = measure_baseline(args, prompts, prefill_prompts, batches)
    _print_table(result, batches)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        _plot(result, batches, args.plot)
    return 0


def _chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from services.codec.chat_template import chat_template_from_tokenizer, render_and_encode
    from services.codec.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    template = chat_template_from_tokenizer(tokenizer)
    return [
        render_and_encode(template, tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(count)
    ]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _print_table(result: dict[str, Any], batches: list[int]) -> None:
    sides = [s for s in ("kvrelay", "transformers") if s in result]
    header = ["metric", *sides] + (["ratio"] if len(sides) == 2 else [])
    metrics: list[tuple[str, list[float], str]] = [
        ("prefill tok/s", [result[s]["prefill_tok_s"] for s in sides], ".0f")
    ]
    for b in batches:
        metrics.append((f"decode tok/s @{b}", [result[s]["decode"][str(b)]["tok_s"] for s in sides], ".1f"))
    for b in batches:
        metrics.append((f"TTFT ms @{b}", [result[s]["decode"][str(b)]["ttft_ms"] for s in sides], ".0f"))
    rows = []
    for name, values, fmt in metrics:
        row = [name, *[format(v, fmt) for v in values]]
        if len(sides) == 2:  # from the measured values: a TTFT under 0.5 ms prints as 0
            ours, theirs = values if not name.startswith("TTFT") else values[::-1]
            row.append(f"{ours / theirs:.2f}x" if theirs > 0 else "n/a")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def _plot(result: dict[str, Any], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in ("kvrelay", "transformers") if s in result]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        values = [result[side]["decode"][str(b)]["tok_s"] for b in batches]
        xs = [j + i * width for j in range(len(batches))]
        bars = ax1.bar(xs, values, width, label=side)
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    ax1.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
    ax1.set_xlabel("concurrent sequences")
    ax1.set_ylabel("decode tok/s (prefill excluded)")
    ax1.set_title(
        f"decode, {result['threads']} threads\nkvrelay: {result['precision']}; transformers: bfloat16"
    )
    ax1.legend()
    bars = ax2.bar(sides, [result[s]["prefill_tok_s"] for s in sides], color=["C0", "C1"][: len(sides)])
    ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_ylabel(f"prefill tok/s ({result['prefill_tokens']}-token prompt)")
    ax2.set_title("prefill")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
