"""The two sides of `kvrelay bench engine`: our engine core, and transformers' generate."""

from __future__ import annotations

import argparse
import time
from typing import Any

from services.cli.bench_engine import median
from services.common.sampling import SamplingParams


def measure_kvrelay(
    args: argparse.Namespace, prompts: list[list[int]], prefill_prompts: list[list[int]], batches: list[int]
) -> dict[str, Any]:
    engine = build_engine(args, max(max(batches), 1))
    prefill_times = []
    for i, prompt in enumerate(prefill_prompts):
        t0 = time.perf_counter()
        run_batch(engine, [prompt], 1, f"prefill{i}")
        prefill_times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"prefill_tok_s": args.prefill_tokens / median(prefill_times[1:])}
    out["decode"] = {}
    for b in batches:
        out["decode"][str(b)] = run_batch(engine, prompts[:b], args.new_tokens, f"b{b}")
    return out


def build_engine(args: argparse.Namespace, batch_size_limit: int) -> Any:
    """An engine core for `args.model` at `args.dtype`, warmed up."""
    from services.common.config import load_config
    from services.engine.core import EngineCore

    cfg = load_config(None)
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"path": str(args.model), "dtype": args.dtype}),
            "limits": cfg.limits.model_copy(update={"batch_size_limit": batch_size_limit}),
        }
    )
    engine = EngineCore.from_config(cfg)
    run_batch(engine, [list(range(100, 116))] * 2, 4, "warm")
    return engine


def run_batch(engine: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.pool.reset_cache()
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    stamps: list[tuple[float, int]] = []  # (time, tokens produced this step)
    num_tokens = 0
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            first.setdefault(o.request_id, now)
            num_tokens += len(o.new_token_ids)
        stamps.append((now, len(outputs)))
    t_all_first = max(first.values())
    decode_tokens = sum(n for t, n in stamps if t > t_all_first)
    decode_s = stamps[-1][0] - t_all_first
    return {
        "tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "ttft_ms": 1000 * median([t - t0 for t in first.values()]),
        "e2e_tok_s": len(prompts) * new_tokens / (stamps[-1][0] - t0),
        "num_tokens": num_tokens,
    }


def measure_baseline(
    args: argparse.Namespace, prompts: list[list[int]], prefill_prompts: list[list[int]], batches: list[int]
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    # Loaded straight into bf16: the same round-to-nearest cast as loading fp32 and calling .to(bf16).
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model.eval()

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        times = []
        for prompt in prefill_prompts:
            ids = torch.tensor([prompt])
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"prefill_tok_s": args.prefill_tokens / median(times[1:]), "decode": {}}
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    for b in batches:
        batch = prompts[:b]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kw = {"input_ids": ids, "attention_mask": mask, "do_sample": False, "pad_token_id": pad_id}
        with torch.inference_mode():
            model.generate(**kw, max_new_tokens=4, min_new_tokens=4)
            stamp = Stamp()
            t0 = time.perf_counter()
            generated = model.generate(
                **kw,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                logits_processor=LogitsProcessorList([stamp]),
            )
            wall = time.perf_counter() - t0
        span = stamp.times[-1] - stamp.times[0]
        out["decode"][str(b)] = {
            "tok_s": b * (len(stamp.times) - 1) / span,
            "ttft_ms": 1000 * (stamp.times[0] - t0),
            "e2e_tok_s": b * args.new_tokens / wall,
            "num_tokens": b * (generated.shape[1] - width),
        }
    return out
