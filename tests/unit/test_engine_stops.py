"""How a request ends: a stop token ends it with STOP, max_tokens with LENGTH (on the fake runner)."""

from __future__ import annotations

import pytest

from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_fakes import make_fake_engine
from tests.engine_helpers import run_to_completion


@pytest.fixture
def engine() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)


def finish_reasons(engine: EngineCore, prompt: list[int], params: SamplingParams) -> list[FinishReason]:
    engine.add_request("c", prompt, params)
    reasons = []
    while engine.has_work():
        reasons += [o.finish_reason for o in engine.step() if o.finish_reason is not None]
    return reasons


def test_stop_token_ends_with_stop_and_max_tokens_with_length(engine: EngineCore) -> None:
    engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = run_to_completion(engine)["probe"][0]
    length = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert finish_reasons(engine, [5, 6, 7], length) == [FinishReason.LENGTH]
    stop = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(first,))
    assert finish_reasons(engine, [5, 6, 7], stop) == [FinishReason.STOP]


def test_a_stop_token_before_min_tokens_is_never_sampled(engine: EngineCore) -> None:
    engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = run_to_completion(engine)["probe"][0]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, stop_token_ids=(first,))
    engine.add_request("held", [5, 6, 7], params)
    tokens = run_to_completion(engine)["held"]
    assert len(tokens) == 4 and first not in tokens
