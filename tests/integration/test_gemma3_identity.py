"""Gemma 3 270M: greedy fp32 output equals transformers' greedy generate on raw prompts, some longer than
the 512-token sliding window, with prefix caching on (fixture from `make fixtures`, recorded by
transformers from the same prepared directory).

Rule (as for SmolLM2, test_engine_identity.py): the first 64 generated tokens are identical, or, where
they diverge, transformers' top-2 logit gap at that position is under 1e-3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.manifest import load_verified_manifest
from services.engine.model_config import ModelConfig
from tests.engine_helpers import make_engine, run_to_completion
from tests.integration.test_engine_identity import assert_matches, submit

pytestmark = pytest.mark.model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "gemma3_270m_greedy_fp32.json"


@pytest.fixture(scope="module")
def fixture(gemma_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    fingerprint = load_verified_manifest(gemma_dir).model_fingerprint
    assert data["model_fingerprint"] == fingerprint, "fixtures are stale: run `make fixtures`"
    return data


def test_fixture_has_ten_raw_prompts_some_past_the_sliding_window(
    gemma_dir: Path, fixture: dict[str, Any]
) -> None:
    config = ModelConfig.from_dir(gemma_dir)
    window = config.kv_window or max(w for w in config.layer_windows if w is not None)
    assert window == 512 and config.kv_window is None  # local layers, and global ones: nothing is freed
    cases = fixture["cases"]
    assert len(cases) >= 10 and all(c["name"].startswith("raw-") for c in cases)
    assert sum(len(c["prompt_token_ids"]) > window for c in cases) >= 3
    assert fixture["num_new_tokens"] == 64


def test_greedy_fp32_matches_transformers_with_prefix_hits(gemma_dir: Path, fixture: dict[str, Any]) -> None:
    engine = make_engine(
        gemma_dir, "float32", enable_prefix_caching=True, max_model_len=2048, kv_cache_memory_mb=256
    )
    cases = fixture["cases"]
    num_tokens = fixture["num_new_tokens"]
    submit(engine, cases, "first", num_tokens)
    first = run_to_completion(engine)
    submit(engine, cases[::-1], "again", num_tokens)  # now every long prompt's prefix is cached
    again = run_to_completion(engine)
    assert engine.stats().prefix_cache_hits > 1500
    for case in cases:
        assert_matches(case, first[f"first/{case['name']}"])
        assert_matches(case, again[f"again/{case['name']}"])
    assert engine.stats().kv_blocks.num_active == 0


def test_bf16_follows_the_fp32_reference(gemma_dir: Path, fixture: dict[str, Any]) -> None:
    """bf16 weights and math (fp32 KV where the C decode kernel runs): the first 8 greedy tokens of
    nearly every prompt are transformers' fp32 ones (bf16 rounding may flip a rare near-tie)."""
    engine = make_engine(gemma_dir, "bfloat16", max_model_len=2048, kv_cache_memory_mb=256)
    cases = fixture["cases"]
    submit(engine, cases, "bf16", 8)
    got = run_to_completion(engine)
    same = [got[f"bf16/{c['name']}"] == c["output_token_ids"][:8] for c in cases]
    assert sum(same) >= len(cases) - 2, same
