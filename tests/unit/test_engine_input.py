"""The one check of a request's values (services/common/engine_input.py), and the engine taking a checked
request as it is."""

from __future__ import annotations

import pytest

from services.common.engine_input import (
    MAX_CACHE_SALT_BYTES,
    CacheBreakpoint,
    cache_written_tokens,
    check_prompt,
    check_request,
    check_unique,
)
from services.common.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingError,
    TokenOutOfRangeError,
)
from services.common.sampling import SamplingParams
from tests.engine_fakes import make_fake_engine
from tests.engine_helpers import drain

VOCAB = 128


@pytest.mark.parametrize(
    ("prompt", "error", "words"),
    [
        ([], EmptyPromptError, "no tokens"),
        ([1, 128], TokenOutOfRangeError, "token ID 128 "),
        ([-1, 2], TokenOutOfRangeError, "token ID -1 "),
        ([1, 2**64], TokenOutOfRangeError, str(2**64)),
        ([1, 2.0], TokenOutOfRangeError, "2.0"),
        ([1, "3"], TokenOutOfRangeError, "'3'|3"),
    ],
)
def test_a_bad_prompt_is_refused_naming_the_token(prompt: list[object], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        check_prompt(prompt, VOCAB)  # type: ignore[arg-type]


def test_a_good_prompt_comes_back_as_a_list_of_ints() -> None:
    assert check_prompt((0, 5, VOCAB - 1), VOCAB) == [0, 5, VOCAB - 1]


def test_check_request_checks_every_value() -> None:
    request = check_request("r-1", [1, 2], SamplingParams(max_tokens=3), VOCAB, priority=-2, cache_salt=b"s")
    assert (request.request_id, request.prompt_token_ids, request.priority) == ("r-1", [1, 2], -2)
    with pytest.raises(InvalidRequestError, match="request_id"):
        check_request("", [1], SamplingParams(), VOCAB)
    with pytest.raises(InvalidSamplingError, match="stop_token_ids"):
        check_request("r", [1], SamplingParams(stop_token_ids=(VOCAB,)), VOCAB)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        check_request("r", [1], SamplingParams(), VOCAB, cache_salt=b"x" * (MAX_CACHE_SALT_BYTES + 1))


def test_check_unique_refuses_a_live_id() -> None:
    check_unique("a", {"b"})
    with pytest.raises(DuplicateRequestError, match="'b'"):
        check_unique("b", {"b"})


def test_the_core_runs_a_checked_request_without_checking_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    request = engine.check("r", [3, 4, 5], SamplingParams(max_tokens=2))
    calls = []
    monkeypatch.setattr(SamplingParams, "validate", lambda *a, **k: calls.append(a))
    engine.add(request)
    outputs = drain(engine)
    assert calls == []
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 2


@pytest.mark.parametrize(
    "points",
    [
        [CacheBreakpoint(4, 300)] * 5,  # over the limit
        [CacheBreakpoint(3, 300), CacheBreakpoint(2, 300)],  # out of prompt order
        [CacheBreakpoint(6, 300)],  # past the prompt
        [CacheBreakpoint(4, 0)],  # kept no time
        [CacheBreakpoint(4, 24 * 3600 + 1)],  # longer than a client may ask
    ],
)
def test_cache_breakpoints_out_of_range_are_refused_naming_them(points: list[CacheBreakpoint]) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_request("r", [1, 2, 3, 4, 5], SamplingParams(), 10, cache_breakpoints=points)
    assert refused.value.param == "cache_breakpoints"


def test_the_tokens_written_per_breakpoint_are_whole_blocks_past_the_cached_ones() -> None:
    points = [CacheBreakpoint(40, 3600), CacheBreakpoint(40, 300), CacheBreakpoint(100, 300)]
    assert cache_written_tokens(points, 0, 16) == (32, 0, 64)  # 40 -> 32, 100 -> 96
    assert cache_written_tokens(points, 48, 16) == (0, 0, 48)  # the cache reached past the first
    assert cache_written_tokens(points, 96, 16) == (0, 0, 0)
