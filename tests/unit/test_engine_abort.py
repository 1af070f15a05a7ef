"""Abort at any point returns every block, on the fake runner: mid-prefill, mid-decode, waiting."""

from __future__ import annotations

import pytest

from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_fakes import make_fake_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 4, 8])
def test_abort_mid_prefill_or_mid_decode_returns_every_block(
    engine: EngineCore, abort_after_steps: int
) -> None:
    engine.add_request("long", list(range(2, 100)), GREEDY)  # 98 tokens: 4 chunks of 32
    engine.add_request("short", [5, 6, 7], GREEDY)
    for _ in range(abort_after_steps):
        engine.step()
        engine.check_invariants()
    assert engine.abort(["long", "short"]) == 2  # neither has finished: short needs 12 steps
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_aborted == 2
    assert stats.kv_blocks.num_active == 0
    assert stats.num_running == stats.num_waiting == 0


def test_abort_request_ends_each_live_sample_under_the_callers_id(engine: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    engine.add_request("par", list(range(2, 20)), params)
    engine.step()  # sample 0's prompt; samples 1 and 2 wait to share it
    engine.step()
    ends = engine.abort_request("par")
    assert [(e.request_id, e.index) for e in ends] == [("par", 0), ("par", 1), ("par", 2)]
    assert all(e.finish_reason is FinishReason.ABORT and e.new_token_ids == [] for e in ends)
    assert all(e.num_prompt_tokens == 18 for e in ends)
    assert engine.abort_request("par") == []  # nothing live any more: not a second abort
    stats = engine.stats()
    assert stats.num_aborted == 1 and stats.kv_blocks.num_active == 0
    engine.check_invariants()
