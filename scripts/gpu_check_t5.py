"""scripts/gpu_check.py stage 13, t5: an encoder-decoder model on the device against the CPU's tokens.

A tiny random T5 (gated GELU as in T5 v1.1 and Flan-T5, tied head; transformers builds its weights, one
state dict) is handed to two engines, one on `--device` and one on the CPU, each in fp32 with TF32 off.
Six sources of 1 to 90 tokens go through each as one batch (the encoder batched and masked, the decoder
continuously batched over the paged cache with its cross KV in blocks of its own, torch attention with the
relative position bias on every device), 16 greedy tokens each. The device's tokens must equal the CPU's
up to the first step whose CPU top-2 margin is under 1e-3, with at least 80% of the steps compared, and
every block must be back in both pools. Under 30 s: the model is tiny, the check is the device path.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

NUM_TOKENS = 16
NEAR_TIE = 1e-3
# 3 encoder and 2 decoder layers, 3 heads of 8 against a d_model of 32 (as tests/tiny_t5.py), byte vocab
TINY_T5: dict[str, Any] = {
    "vocab_size": 259, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 3, "num_decoder_layers": 2,
    "num_heads": 3, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
    "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "initializer_factor": 1.5,
    "feed_forward_proj": "gated-gelu", "tie_word_embeddings": True,
}  # fmt: skip


def stage_t5(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    torch.manual_seed(13)
    model = T5ForConditionalGeneration(T5Config(**TINY_T5)).eval()
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    raw = {**TINY_T5, "architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}
    raw |= {"is_encoder_decoder": True, "scale_decoder_outputs": True}
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 7, 30, 60, 75, 90]
    sources = [[*torch.randint(3, 259, (n - 1,), generator=generator).tolist(), 1] for n in lengths]
    runs = {}
    for device in (args.device, "cpu"):
        core = _engine(raw, {n: t.to(device) for n, t in state.items()}, device)
        runs[device] = _greedy(core, sources)
        runs[device + "/blocks_held"] = core.stats().kv_blocks.num_active
        core.close()
    device_tokens, (cpu_tokens, margins) = runs[args.device][0], runs["cpu"]
    compared = total = 0
    diverged_before_a_tie = []
    for i, (got, want) in enumerate(zip(device_tokens, cpu_tokens, strict=True)):
        total += NUM_TOKENS
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                if margins[i][step] >= NEAR_TIE:
                    diverged_before_a_tie.append({"source": i, "step": step, "margin": margins[i][step]})
                break
            compared += 1
    held = runs[args.device + "/blocks_held"] + runs["cpu/blocks_held"]
    return {
        "ok": not diverged_before_a_tie and compared >= 0.8 * total and held == 0,
        "steps_compared": compared, "steps": total, "diverged_before_a_tie": diverged_before_a_tie,
        "blocks_held": held, "source_lengths": lengths, "seconds": time.perf_counter() - started,
    }  # fmt: skip


def _engine(raw: dict[str, Any], state: dict[str, Any], device: str) -> Any:
    from services.common.config import KvrelayConfig
    from services.engine.loading.factory import build_core_from_loaded
    from services.engine.loading.loader import load_state_dict

    loaded = load_state_dict(raw, state, dtype="float32", fingerprint="gpu-check-t5")
    settings = {
        "engine": {"device": device, "kv_cache_memory_mb": 16, "gpu_memory_utilization": 0.2},
        "model": {"dtype": "float32"},
    }
    return build_core_from_loaded(loaded, KvrelayConfig.model_validate(settings))


def _greedy(core: Any, sources: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Each source's greedy tokens (EOS banned to the end) and each step's top-2 logprob margin."""
    from services.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=2)
    for i, source in enumerate(sources):
        core.add_request(f"t{i}", [0], params, encoder_token_ids=source)  # the decoder starts at token 0
    tokens: dict[str, list[int]] = {f"t{i}": [] for i in range(len(sources))}
    margins: dict[str, list[float]] = {f"t{i}": [] for i in range(len(sources))}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            for logprob in out.logprobs or ():
                top = sorted((value for _, value in logprob.top), reverse=True)
                margins[out.request_id].append(top[0] - top[1] if len(top) > 1 else float("inf"))
    names = [f"t{i}" for i in range(len(sources))]
    return [tokens[n] for n in names], [margins[n] for n in names]
