"""gpu_check's kernel stages: 6 kernels (the Triton kernels against the float64 reference at real shapes)
and 7 attention (a paged-decode microbenchmark against the copy bandwidth). Run through
scripts/gpu_check.py, which puts the repository root on sys.path; services are imported inside the
functions."""

from __future__ import annotations

import argparse
from typing import Any

from gpu_check_model import stage_copy, timed

# name: (rows as (context_len, new tokens), kv_heads, GQA ratio, head_dim, block_size, window); the
# dry run (--check-shape tiny, on the CPU interpreter) divides every context by 32.
KERNEL_CASES: dict[str, tuple[list[tuple[int, int]], int, int, int, int, int | None]] = {
    "llama8b_decode": ([(2048, 1)] * 8, 8, 4, 128, 16, None),
    "llama8b_mixed": ([(1500, 1)] * 4 + [(1024, 512), (300, 300)], 8, 4, 128, 16, None),
    "llama1b_split_decode": ([(4096, 1), (3000, 1)], 8, 4, 64, 16, None),
    "gemma3_window_d256": ([(1800, 1)] * 4 + [(900, 100)], 1, 4, 256, 16, 512),
    "qwen7b_ratio7_block32": ([(700, 1)] * 4 + [(600, 64)], 4, 7, 128, 32, None),
}


def kernel_step(rows: list[tuple[int, int]], kv_heads: int, ratio: int, head_dim: int, block_size: int,
                device: str, dtype: Any, seed: int = 0) -> tuple[Any, ...]:  # fmt: skip
    """A step over scattered blocks: (metadata, cache, q, k, v, flat rows) with this step's K/V stored."""
    import torch

    from services.engine.layers.attention import write_kv
    from services.engine.layers.attention_metadata import RowSpec, build_metadata

    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in rows) + 1
    order = torch.randperm(num_blocks, device="cpu").tolist()
    specs, taken = [], 0
    for ctx, new in rows:
        n = -(-ctx // block_size)
        specs.append(RowSpec(order[taken : taken + n], ctx - new, new))
        taken += n
    decode = [r for r in specs if r.num_new_tokens == 1]
    prefill = [r for r in specs if r.num_new_tokens != 1]
    meta = build_metadata(decode, prefill, block_size, torch.device(device))
    shape = (num_blocks * block_size, 2, kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    tokens = meta.num_tokens
    q = torch.randn(tokens, kv_heads * ratio, head_dim, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype) for _ in "kv")
    write_kv(cache, meta.slot_mapping, k, v)
    return meta, cache, q, k, v, [*decode, *prefill]


def stage_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Per case, the bf16 kernels' max abs error (<= 2e-2, beside torch-native's on the same inputs), and
    the fp32 kernels' error on the same values in units of one key (self_check.one_key_ratio, <=
    ONE_KEY_LIMIT): 2e-2 absolute cannot see a mask that drops or adds one key of 4096 (it moves the
    output by ~1/4096 of a value); one_key_ratio reads it as 2-5, exact masks as ~3e-5."""
    import torch

    from services.engine.layers.attention import paged_attention
    from services.engine.layers.triton_self_check import ONE_KEY_LIMIT, one_key_ratio
    from services.engine.ops.reference import reference_attention
    from services.engine.ops.triton.dispatch import KernelSpec
    from services.engine.ops.triton.launch import TritonAttention

    shrink = 32 if args.check_shape == "tiny" else 1
    results: dict[str, Any] = {}
    for name, (rows, kv_heads, ratio, head_dim, block_size, window) in KERNEL_CASES.items():
        rows = [(max(1, c // shrink), max(1, n // shrink) if n > 1 else n) for c, n in rows]
        meta, cache, q, k, v, flat = kernel_step(rows, kv_heads, ratio, head_dim, block_size, args.device,
                                                 torch.bfloat16)  # fmt: skip
        spec = KernelSpec(torch.bfloat16, head_dim, block_size)
        attention = TritonAttention(spec, kv_heads * ratio, kv_heads)
        got = attention.attend(q, k, v, cache, meta, window=window)
        native = paged_attention(q, k, v, cache, meta, window=window)
        want = reference_attention(q, cache, flat, block_size, window=window).double()
        error, native_error = (float((t.double() - want).abs().max()) for t in (got, native))
        exact = TritonAttention(KernelSpec(torch.float32, head_dim, block_size), kv_heads * ratio, kv_heads)
        q32, k32, v32, cache32 = (t.float() for t in (q, k, v, cache))  # the same values
        got32 = exact.attend(q32, k32, v32, cache32, meta, window=window)
        results[name] = {
            "max_abs_error": error,
            "torch_native_max_abs_error": native_error,
            "error_over_torch_native": error / max(native_error, 1e-12),
            "fp32_one_key_ratio": one_key_ratio(got32, q32, cache32, flat, block_size, window=window),
            "split_kv": attention._layout(meta).split_decode,
        }
    ok = all(
        r["max_abs_error"] <= 2e-2 and r["fp32_one_key_ratio"] <= ONE_KEY_LIMIT for r in results.values()
    )
    return {"ok": ok, "threshold": 2e-2, "one_key_limit": ONE_KEY_LIMIT, **results}


def stage_attention(args: argparse.Namespace) -> dict[str, Any]:
    copy = stage_copy(args)["gb_per_s"]
    batch, ctx = (4, 128) if args.check_shape == "tiny" else (64, 4096)
    results: dict[str, Any] = {"copy_gb_per_s": copy}
    for label, rows, split in (("b64_auto", batch, None), ("b64_split", batch, True), ("b8_auto", 8, None)):
        results[label] = _time_decode_attention(args, rows, ctx, split, copy)
    target = results["b64_auto"]["triton_share_of_copy"] >= 0.6
    return {"ok": True, "meets_60_percent": target, **results}


def _time_decode_attention(
    args: argparse.Namespace, batch: int, ctx: int, split: bool | None, copy_gb_per_s: float
) -> dict[str, Any]:
    """One layer's decode attention (8 KV heads, GQA 4, head size 128, bf16) timed for the Triton kernel
    and for torch-native attention; the KV bytes each call must read, over its time."""
    import torch

    from services.engine.layers.attention import paged_attention
    from services.engine.ops.triton.dispatch import KernelSpec
    from services.engine.ops.triton.launch import TritonAttention

    meta, cache, q, k, v, _ = kernel_step([(ctx, 1)] * batch, 8, 4, 128, 16, args.device, torch.bfloat16)
    attention = TritonAttention(KernelSpec(torch.bfloat16, 128, 16), 32, 8, split=split)
    kv_bytes = batch * ctx * 2 * 8 * 128 * 2
    runs = {
        "triton": lambda: attention.attend(q, k, v, cache, meta),
        "torch_native": lambda: paged_attention(q, k, v, cache, meta),
    }
    row: dict[str, Any] = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes}
    iterations = 2 if args.check_shape == "tiny" else 20
    for kind, run in runs.items():
        run()
        seconds = timed(args.device, lambda run=run: [run() for _ in range(iterations)]) / iterations
        row[f"{kind}_us"] = round(1e6 * seconds, 1)
        row[f"{kind}_gb_per_s"] = round(kv_bytes / seconds / 1e9, 1)
        row[f"{kind}_share_of_copy"] = round(kv_bytes / seconds / 1e9 / copy_gb_per_s, 3)
    return row
