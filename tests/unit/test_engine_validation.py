"""Bad input raises a typed error with a clear message and allocates nothing (on the fake runner)."""

from __future__ import annotations

import pytest

from services.common.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingError,
    TokenOutOfRangeError,
)
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_fakes import make_fake_engine


@pytest.fixture
def engine() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4)


def assert_nothing_allocated(engine: EngineCore) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks.num_active == 0
    engine.check_invariants()


@pytest.mark.parametrize(
    ("prompt", "params", "error", "words"),
    [
        ([], SamplingParams(), EmptyPromptError, "no tokens"),
        ([5, 128], SamplingParams(), TokenOutOfRangeError, "128"),
        ([5, -1], SamplingParams(), TokenOutOfRangeError, "-1"),
        ([5], SamplingParams(max_tokens=0), InvalidSamplingError, "max_tokens"),
        ([5], SamplingParams(max_tokens=-3), InvalidSamplingError, "max_tokens"),
        ([5] * 500, SamplingParams(max_tokens=20), ContextLengthExceededError, "context"),
        ([5], SamplingParams(temperature=-1.0), InvalidSamplingError, "temperature"),
    ],
)
def test_bad_request_raises_a_typed_error_and_allocates_nothing(
    engine: EngineCore, prompt: list[int], params: SamplingParams, error: type, words: str
) -> None:
    with pytest.raises(error, match=words):
        engine.add_request("bad", prompt, params)
    assert_nothing_allocated(engine)


def test_duplicate_request_id_is_refused(engine: EngineCore) -> None:
    engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    engine.abort(["dup"])
    assert_nothing_allocated(engine)


def test_an_id_with_live_samples_is_refused_whatever_n_the_new_request_asks() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    engine.add_request("dup", [3, 4], SamplingParams(n=2, temperature=1.0, max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [3, 4], SamplingParams(max_tokens=2))
    assert engine.abort(["dup"]) == 2
    assert_nothing_allocated(engine)


@pytest.mark.parametrize(
    ("params", "export_kv_from"),
    [(SamplingParams(n=2, temperature=1.0), 0), (SamplingParams(), 3), (SamplingParams(), -1)],
)
def test_a_remote_prefill_takes_one_sample_and_a_skip_inside_the_prompt(
    engine: EngineCore, params: SamplingParams, export_kv_from: int
) -> None:
    with pytest.raises(InvalidRequestError, match="remote prefill"):
        engine.add_request("r", [3, 4, 5], params, export_kv_from=export_kv_from)
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("", [3, 4, 5], SamplingParams())
    assert_nothing_allocated(engine)
