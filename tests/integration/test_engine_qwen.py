"""Qwen2 and Qwen3: tiny random-weight models built here with transformers give the same greedy tokens
through our engine as through transformers' `generate`, in mixed batches and again from the prefix cache;
in bf16 they follow transformers' fp32 model logprob by logprob."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.manifest import MANIFEST_NAME
from services.common.sampling import SamplingParams
from services.engine.loading.prepare import prepare_from_dir
from tests.engine_helpers import (
    assert_follows_reference,
    make_engine,
    run_to_completion,
    run_with_logprobs,
    teacher_forced_logprobs,
)
from tests.tiny_model import make_tiny_qwen2, make_tiny_qwen3

NUM_NEW_TOKENS = 24
BLOCK_SIZE = 16
# bf16 against fp32, in nats (measured on these models: bf16 rounding moves logprobs by up to 0.13 and
# flips fp32 near-ties of up to 0.07).
BF16_NEAR_TIE = 0.2
BF16_LOGPROB_ATOL = 0.3


def prompts(vocab_size: int = 128) -> dict[str, list[int]]:
    """Short prompts and ones spanning several KV blocks; two share a 40-token prefix."""
    g = torch.Generator().manual_seed(7)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, vocab_size, (n,), generator=g).tolist()

    shared = tokens(40)
    return {
        "short": tokens(3),
        "one-block-plus": tokens(BLOCK_SIZE + 3),
        "shared-a": shared + tokens(9),
        "shared-b": shared + tokens(23),
        "long": tokens(90),
    }


def transformers_fp32(model_dir: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def transformers_greedy(model_dir: Path, cases: dict[str, list[int]]) -> dict[str, list[int]]:
    model = transformers_fp32(model_dir)
    out = {}
    for name, prompt in cases.items():
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                pad_token_id=1,
            )
        out[name] = generated[0, len(prompt) :].tolist()
    return out


def engine_greedy_twice(
    model_dir: Path, cases: dict[str, list[int]], **engine: Any
) -> list[dict[str, list[int]]]:
    """All prompts batched, then all again (now prefix-cache hits), in reverse order."""
    core = make_engine(model_dir, "float32", enable_prefix_caching=True, block_size=BLOCK_SIZE, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    runs = []
    for order in (list(cases), list(cases)[::-1]):
        for name in order:
            core.add_request(name, cases[name], params)
        runs.append(run_to_completion(core))
    assert core.stats().prefix_cache_hits > 0
    assert core.stats().kv_blocks.num_active == 0
    return runs


MODELS: dict[str, tuple[Callable[..., Path], dict[str, Any]]] = {
    "qwen2-tied": (make_tiny_qwen2, {}),
    "qwen2-untied": (make_tiny_qwen2, {"tie_word_embeddings": False}),
    "qwen2-sliding-window": (
        make_tiny_qwen2,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3-tied": (make_tiny_qwen3, {}),
    "qwen3-untied": (make_tiny_qwen3, {"tie_word_embeddings": False}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    make, overrides = MODELS[name]
    model_dir = make(tmp_path / name, **overrides)
    cases = prompts()
    want = transformers_greedy(model_dir, cases)
    for run in engine_greedy_twice(model_dir, cases):
        assert run == want


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3-tied"])
def test_decode_steps_on_the_torch_path_match_too(tmp_path: Path, name: str) -> None:
    """Steps of every size on the torch layer (Qwen2 otherwise decodes in the fused C kernel)."""
    make, overrides = MODELS[name]
    model_dir = make(tmp_path / name, **overrides)
    cases = prompts()
    want = transformers_greedy(model_dir, cases)
    core = make_engine(model_dir, "float32", block_size=BLOCK_SIZE)
    core.runner.model.kernels = None  # type: ignore[attr-defined]  # the fused-layer kernel: off
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    for case, prompt in cases.items():
        core.add_request(case, prompt, params)
    assert run_to_completion(core) == want


def test_prepare_from_a_plain_hf_directory_serves_qwen3(tmp_path: Path) -> None:
    src = make_tiny_qwen3(tmp_path / "src")
    (src / MANIFEST_NAME).unlink()
    manifest = prepare_from_dir(src, tmp_path / "prepared")
    assert "model.safetensors" in manifest.files
    cases = {"p": prompts()["long"]}
    core = make_engine(tmp_path / "prepared", "float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    core.add_request("p", cases["p"], params)
    assert run_to_completion(core)["p"] == transformers_greedy(src, cases)["p"][:8]
    shutil.rmtree(src)


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3-tied"])
def test_bf16_follows_fp32_transformers_logprob_by_logprob(tmp_path: Path, name: str) -> None:
    """bf16 weights and math, every generated token of every prompt against transformers' fp32 model read
    along the same tokens (`assert_follows_reference`). Not token identity: these random-weight models
    have near-ties (top-2 gaps of 0.01 to 0.04 nats on these prompts) that bf16 rounding legitimately
    flips, and transformers' own bf16 rounds in another order, so no bf16 reference is exact either."""
    make, overrides = MODELS[name]
    model_dir = make(tmp_path / name, **overrides)
    reference = transformers_fp32(model_dir)
    core = make_engine(model_dir, "bfloat16", block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=5)
    cases = prompts()
    for case, prompt in cases.items():
        core.add_request(case, prompt, params)
    got = run_with_logprobs(core)
    for case, prompt in cases.items():
        tokens = [t.token_id for t in got[case]]
        assert len(tokens) == NUM_NEW_TOKENS, case
        assert_follows_reference(
            f"{name} {case}",
            got[case],
            teacher_forced_logprobs(reference, prompt, tokens),
            near_tie=BF16_NEAR_TIE,
            logprob_atol=BF16_LOGPROB_ATOL,
            banned_token_ids=core.eos_token_ids,
        )
