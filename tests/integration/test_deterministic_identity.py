"""engine.deterministic on the real model, for every weight format the mode allows: the identity suite's
greedy and seeded sampled requests give bitwise the same token IDs and logprobs alone, among 31 others,
after a prefix-cache hit, across a preemption, with another chunk size, prefilled on another engine, and
from a shared-tier hit (tests/identity_suite.py). Without the mode they differ (scripts/identity_report.py,
docs/deterministic.md)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.identity_suite import CONDITIONS, Suite, differing, tracked_requests
from tests.kv_helpers import cache_redis_url

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with cache_redis_url(64) as url:
        yield url


@pytest.mark.parametrize("weights", ["gguf-int8", "gguf", "safetensors"])
def test_every_condition_gives_the_bits_of_the_request_alone(
    model_dir: Path, redis_url: str, weights: str
) -> None:
    suite = Suite(model_dir, weights, True, redis_url, uuid.uuid4().bytes, tracked_requests())
    conditions = suite.conditions()
    reference = conditions.pop("alone")()
    assert suite.loaded is not None and suite.loaded.numerics == "deterministic"
    assert suite.loaded.weights == weights
    assert all(len(answer) == 8 for answer in reference.values())
    broken = {name: differing(reference, run()) for name, run in conditions.items()}
    assert {name: names for name, names in broken.items() if names} == {}
    assert set(broken) | {"alone"} == set(CONDITIONS)
