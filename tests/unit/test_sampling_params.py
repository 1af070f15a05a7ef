"""SamplingParams validation: every rejection names the offending parameter."""

from __future__ import annotations

import math

import pytest

from services.common.errors import InvalidRequestError, InvalidSamplingError
from services.common.sampling import SamplingParams


def test_defaults_are_valid_and_sample_at_temperature_one() -> None:
    params = SamplingParams()
    params.validate(vocab_size=100)
    assert not params.is_greedy


def test_temperature_zero_and_below_epsilon_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_edge_values_within_range_are_accepted() -> None:
    SamplingParams(
        n=16,
        temperature=100.0,
        top_p=1e-9,
        top_k=0,
        min_p=1.0,
        repetition_penalty=1e-3,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        seed=2**63 - 1,
        max_tokens=1,
        min_tokens=1,
        stop_token_ids=(0, 99),
        logprobs=20,
    ).validate(vocab_size=100)
    SamplingParams(seed=0, logprobs=0).validate()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": True}, "n"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_out_of_range_value_raises_error_naming_the_param(kwargs: dict[str, object], param: str) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidSamplingError) as excinfo:
        params.validate(vocab_size=100)
    assert excinfo.value.param == param
    assert param in str(excinfo.value)


def test_stop_token_outside_vocab_is_rejected_only_when_vocab_is_known() -> None:
    params = SamplingParams(stop_token_ids=(5, 100))
    params.validate()
    with pytest.raises(InvalidSamplingError) as excinfo:
        params.validate(vocab_size=100)
    assert excinfo.value.param == "stop_token_ids"


def test_sampling_error_is_an_invalid_request_error() -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=0.0).validate()
