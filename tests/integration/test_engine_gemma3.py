"""Gemma 3 on tiny random-weight models built here with transformers: the same greedy tokens as
transformers' `generate`, with local layers (8-token windows) around a global one, prompts far longer
than the window, prefix-cache hits, and blocks freed while running when every layer is local.
The real Gemma 3 270M is checked in test_gemma3_identity.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.sampling import SamplingParams
from services.engine.scheduling.block_pool import NO_BLOCK
from tests.engine_helpers import make_engine
from tests.integration.test_engine_qwen import (
    NUM_NEW_TOKENS,
    engine_greedy_twice,
    prompts,
    transformers_greedy,
)
from tests.tiny_model import make_tiny_gemma3

ALL_LOCAL = ["sliding_attention"] * 4

MODELS: dict[str, dict[str, Any]] = {
    "mixed-tied": {},
    "mixed-untied": {"tie_word_embeddings": False},
    "final-softcap": {"final_logit_softcapping": 3.0},
    "all-local": {"layer_types": ALL_LOCAL},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    model_dir = make_tiny_gemma3(tmp_path / name, **MODELS[name])
    cases = prompts()
    want = transformers_greedy(model_dir, cases)
    for run in engine_greedy_twice(model_dir, cases):
        assert run == want


def test_all_local_model_frees_blocks_behind_the_window_and_still_matches(tmp_path: Path) -> None:
    model_dir = make_tiny_gemma3(tmp_path / "all-local", layer_types=ALL_LOCAL)
    cases = prompts()
    want = transformers_greedy(model_dir, cases)
    core = make_engine(model_dir, "float32", enable_prefix_caching=True, block_size=4)
    assert core.kv.window == 8
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    for name, prompt in cases.items():
        core.add_request(name, prompt, params)
    got: dict[str, list[int]] = {}
    max_freed = 0
    while core.has_work():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        core.check_invariants()
        running = core.scheduler.running
        max_freed = max([max_freed, *(r.block_ids.count(NO_BLOCK) for r in running)])
        for r in running:  # never more than the window (plus a partial block each side) stays held
            assert len(r.block_ids) - r.block_ids.count(NO_BLOCK) <= 8 // 4 + 2
    assert max_freed >= (90 + NUM_NEW_TOKENS - 8) // 4 - 1
    assert got == want
    assert core.stats().kv_blocks.num_active == 0


def test_a_global_layer_keeps_every_block(tmp_path: Path) -> None:
    core = make_engine(make_tiny_gemma3(tmp_path / "mixed"), "float32", block_size=4)
    assert core.kv.window is None
