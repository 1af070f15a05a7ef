"""Seeded sampling is keyed on (seed, output position): the same tokens alone, in a full batch and
after a preemption; different seeds give different tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode
from services.codec.text.tokenizer import Tokenizer
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_helpers import make_engine

pytestmark = pytest.mark.model

NUM_TOKENS = 24


def chat(model_dir: Path, text: str) -> list[int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    return render_and_encode(
        chat_template_from_tokenizer(tokenizer), tokenizer, [{"role": "user", "content": text}]
    )


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=seed, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS
    )


def run(engine: EngineCore, watch: str) -> tuple[dict[str, list[int]], int]:
    """Outputs by request, and how often `watch` was preempted."""
    outputs: dict[str, list[int]] = {}
    preempted = 0
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        for request in engine.scheduler.live_samples(watch):
            preempted = max(preempted, request.num_preemptions)
        engine.check_invariants()
    return outputs, preempted


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    return chat(model_dir, "Write a short poem about the sea.")


@pytest.fixture(scope="module")
def alone(model_dir: Path, prompt: list[int]) -> list[int]:
    engine = make_engine(model_dir, "float32")
    engine.add_request("x", prompt, sampled(1234))
    return run(engine, "x")[0]["x"]


def test_seed_gives_the_same_tokens_in_a_full_batch(
    model_dir: Path, prompt: list[int], alone: list[int]
) -> None:
    engine = make_engine(model_dir, "float32", batch_size_limit=8)
    others = ["Why is the sky blue?", "List three uses of Python.", "How do airplanes fly?"]
    for i in range(7):
        engine.add_request(f"o{i}", chat(model_dir, others[i % 3]), sampled(i))
    engine.add_request("x", prompt, sampled(1234))
    assert run(engine, "x")[0]["x"] == alone


def test_seed_gives_the_same_tokens_after_a_preemption(
    model_dir: Path, prompt: list[int], alone: list[int]
) -> None:
    # 34 blocks of 16 tokens: enough for one 512-token sequence, not for all of these at once; a 512-token
    # step budget admits them together, so the KV runs out while they decode.
    engine = make_engine(
        model_dir, "float32", max_model_len=512, kv_cache_memory_mb=24, max_num_batched_tokens=512
    )
    long_prompt = chat(model_dir, "Tell me a long story about a lighthouse keeper. " * 12)
    for i in range(3):
        engine.add_request(
            f"o{i}", long_prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        )
    engine.add_request("x", prompt, sampled(1234))
    outputs, preempted = run(engine, "x")
    assert preempted >= 1
    assert outputs["x"] == alone


def test_different_seeds_give_different_tokens(model_dir: Path, prompt: list[int], alone: list[int]) -> None:
    engine = make_engine(model_dir, "float32")
    engine.add_request("y", prompt, sampled(4321))
    assert run(engine, "y")[0]["y"] != alone
