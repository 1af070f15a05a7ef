"""Greedy fp32 output equals transformers' greedy generate (fixtures from `make fixtures`).

Rule: the first 64 generated tokens are identical, or, where they diverge, transformers' top-2 logit gap
at that position is under 1e-3 (a near-tie that any change of kernel may flip).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.manifest import load_verified_manifest
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2_greedy_fp32.json"
MAX_GAP = 1e-3


@pytest.fixture(scope="module")
def fixture(model_dir: Path) -> dict[str, Any]:
    data = json.loads(FIXTURE.read_text())
    fingerprint = load_verified_manifest(model_dir).model_fingerprint
    assert data["model_fingerprint"] == fingerprint, "fixtures are stale: run `make fixtures`"
    return data


def long_cases(count: int) -> list[dict[str, Any]]:
    """The fixture's `count` shortest cases past 500 prompt tokens: a few KV segments each, seconds to
    compute (the KV tier tests)."""
    cases = json.loads(FIXTURE.read_text())["cases"]
    return sorted(
        (c for c in cases if len(c["prompt_token_ids"]) >= 500), key=lambda c: len(c["prompt_token_ids"])
    )[:count]


def params(num_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens)


def submit(engine: EngineCore, cases: list[dict[str, Any]], tag: str, num_tokens: int) -> None:
    for case in cases:
        engine.add_request(f"{tag}/{case['name']}", case["prompt_token_ids"], params(num_tokens))


def assert_matches(case: dict[str, Any], got: list[int]) -> None:
    want = case["output_token_ids"]
    assert len(got) == len(want), case["name"]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            gap = case["top2_gaps"][i]
            assert gap < MAX_GAP, f"{case['name']}: diverged at token {i} where the top-2 gap is {gap:.2e}"
            return


def test_fixture_covers_chat_raw_short_and_long_prompts(fixture: dict[str, Any]) -> None:
    cases = fixture["cases"]
    assert len(cases) >= 20
    names = [c["name"] for c in cases]
    assert any(n.startswith("chat-") for n in names) and any(n.startswith("raw-") for n in names)
    assert sum(len(c["prompt_token_ids"]) >= 500 for c in cases) >= 4


def test_greedy_fp32_matches_transformers_in_mixed_batches_with_prefix_hits(
    model_dir: Path, fixture: dict[str, Any]
) -> None:
    engine = make_engine(model_dir, "float32", batch_size_limit=32, enable_prefix_caching=True)
    cases = fixture["cases"]
    num_tokens = fixture["num_new_tokens"]
    submit(engine, cases, "first", num_tokens)
    first = run_to_completion(engine)
    # Second pass: the same prompts again, mixed with a shuffled order: their prefixes are now cached.
    submit(engine, cases[::-1], "again", num_tokens)
    again = run_to_completion(engine)
    assert engine.stats().prefix_cache_hits > 0
    for case in cases:
        assert_matches(case, first[f"first/{case['name']}"])
        assert_matches(case, again[f"again/{case['name']}"])
    assert engine.stats().kv_blocks.num_active == 0


def test_greedy_fp32_matches_transformers_under_preemption(model_dir: Path, fixture: dict[str, Any]) -> None:
    engine = make_engine(
        model_dir, "float32", batch_size_limit=32, max_model_len=2048, kv_cache_memory_mb=100
    )
    cases = fixture["cases"]
    submit(engine, cases, "tight", fixture["num_new_tokens"])
    got = run_to_completion(engine)
    assert engine.stats().num_preemptions >= 1
    for case in cases:
        assert_matches(case, got[f"tight/{case['name']}"])
    assert engine.stats().kv_blocks.num_active == 0


def test_greedy_over_the_gguf_blocks_matches_transformers(model_dir: Path, fixture: dict[str, Any]) -> None:
    """model.weights gguf (Q4_1/Q8_0 as stored, fp32 activations): the blocks dequantize to exactly the
    fp32 directory's weights, so only the order of fp32 sums differs, as between any two kernels."""
    engine = make_engine(model_dir, "float32", batch_size_limit=32, weights="gguf")
    assert engine.runner.model.weight_format.name == "Q4_1_SPLIT"  # Q4_1, each row regrouped at load
    cases = fixture["cases"]
    submit(engine, cases, "gguf", fixture["num_new_tokens"])
    got = run_to_completion(engine)
    for case in cases:
        assert_matches(case, got[f"gguf/{case['name']}"])
    assert engine.stats().kv_blocks.num_active == 0
