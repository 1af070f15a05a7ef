"""n > 1: samples of one request share its prompt blocks, differ from each other under one seed, and come
out under the caller's request ID with their sample index (on the fake runner)."""

from __future__ import annotations

import pytest

from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_fakes import fake_runner, make_fake_engine
from tests.engine_helpers import run_samples


@pytest.fixture
def engine() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)


def test_parallel_samples_share_the_prompt_blocks(engine: EngineCore) -> None:
    prompt = list(range(2, 60))  # 7 full blocks of 8
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=6, ignore_eos=True)
    engine.add_request("par", prompt, params)
    shared_seen = 0
    while engine.has_work():
        engine.step()
        engine.check_invariants()
        refs = engine.scheduler.held_block_refs()
        shared_seen = max(shared_seen, sum(1 for n in refs.values() if n == 4))
    assert shared_seen >= 7  # every full prompt block held by all four samples at once
    assert engine.stats().kv_blocks.num_active == 0


def test_parallel_samples_with_a_seed_differ_from_each_other(engine: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    engine.add_request("p", [4, 5, 6], params)
    outs = run_samples(engine)
    assert len({tuple(outs[k]) for k in (("p", 0), ("p", 1), ("p", 2))}) == 3


def test_samples_after_the_first_compute_only_the_prompts_last_token(engine: EngineCore) -> None:
    prompt = list(range(2, 60))  # 58 tokens: sample 0 prefills, the others hit its 7 cached blocks
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=2, ignore_eos=True)
    engine.add_request("par", prompt, params)
    run_samples(engine)
    runner = fake_runner(engine)
    assert runner.computed_for(("par", 0))[:2] == [(0, 32), (32, 58)]
    for index in (1, 2):
        assert runner.computed_for(("par", index))[0] == (56, 58)


def test_a_seeded_sample_i_is_the_request_seeded_seed_plus_i(engine: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=10, n=3, max_tokens=8, ignore_eos=True)
    engine.add_request("p", [4, 5, 6], params)
    together = run_samples(engine)
    for index in range(3):
        alone = SamplingParams(temperature=1.0, seed=10 + index, max_tokens=8, ignore_eos=True)
        engine.add_request(f"alone{index}", [4, 5, 6], alone)
        assert run_samples(engine)[(f"alone{index}", 0)] == together[("p", index)]
