"""The shared tier misbehaving under the real model (fp32), through an in-test proxy in front of a real
cache Redis: slowed, the cost model recomputes instead of fetching, and fetches again once it is fast;
silent (accepting, never answering) or cut mid-reply, every request is answered on the no-cache path with
the fixture's greedy tokens, the breaker opens, and it closes when the tier answers again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from services.engine.kv_tiers import KVTiers
from tests.engine_helpers import drain, make_engine
from tests.fault_proxy import CUT, PASS, SILENT, SLOW, FaultProxy
from tests.integration.test_engine_identity import assert_matches, long_cases
from tests.ports import free_port
from tests.stack_helpers import wait_until

pytestmark = pytest.mark.model

SEGMENT = 64
NUM_TOKENS = 16  # the fixture's first tokens: enough to tell wrong KV from right


@pytest.fixture(scope="module")
def case() -> dict[str, Any]:
    (full,) = long_cases(1)
    return {
        **full,
        "output_token_ids": full["output_token_ids"][:NUM_TOKENS],
        "top2_gaps": full["top2_gaps"][:NUM_TOKENS],
    }


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    port = free_port()
    cache = start_cache_redis(port, maxmemory_mb=256)
    faulty = FaultProxy(port)
    yield faulty
    faulty.close()
    stop_cache_redis(cache)


def build(model_dir: Path, proxy: FaultProxy) -> EngineCore:
    tiers = {
        "shared_url": f"redis://127.0.0.1:{proxy.port}/0",
        "segment_tokens": SEGMENT,
        "timeout_ms": 1500,  # a silent tier costs this per call
        "fetch_deadline_ms": 60_000,  # a slow tier is left to the cost model, not the deadline
    }
    return make_engine(model_dir, kv_tiers=tiers)


def answer(core: EngineCore, rid: str, case: dict[str, Any]) -> int:
    """Answer `case` from an empty pool; check its tokens; the prompt tokens it did not compute."""
    assert core.reset_prefix_cache()
    core.add_request(
        rid, case["prompt_token_ids"], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    )
    outputs = drain(core)
    assert_matches(case, [t for o in outputs for t in o.new_token_ids])
    return outputs[-1].num_cached_tokens


def test_a_slow_silent_or_cut_shared_tier_costs_recompute_never_a_wrong_token(
    model_dir: Path, proxy: FaultProxy, case: dict[str, Any]
) -> None:
    core = build(model_dir, proxy)
    tiers = cast(KVTiers, core.tiers)
    costs, breaker = tiers.tiers.costs, tiers.tiers.breakers["shared"]
    costs.probe_interval_s = 3600.0  # no probe until the test asks for one
    breaker.failure_threshold, breaker.cooldown_s = 1, 0.2
    expected = (len(case["prompt_token_ids"]) - 1) // SEGMENT * SEGMENT
    try:
        assert answer(core, "cold", case) == 0
        assert tiers.writes.writer.wait_idle(60)
        assert answer(core, "fast", case) == expected  # the tier measured fast, prefill measured

        proxy.mode, proxy.delay_s = SLOW, 1.0  # 1 s a call: far slower than recomputing 64 tokens
        answer(core, "slowing", case)  # learns it: a first slow fetch, then the first probe, then no more
        before = costs.recompute_instead["shared"]
        assert answer(core, "slow", case) == 0  # not asked at all: recomputed
        assert costs.recompute_instead["shared"] == before + 1

        proxy.mode = PASS
        costs.probe_interval_s = 0.0  # a probe is due: it finds the tier fast again
        assert answer(core, "fast-again", case) == expected
        assert costs.recompute_instead["shared"] == before + 1

        proxy.mode = SILENT  # accepts, never answers: each call ends at its socket timeout
        assert answer(core, "silent", case) == 0
        assert not breaker.allow() or breaker.num_failures >= 1
        proxy.mode = PASS
        wait_until(breaker.allow, 10, "the breaker letting a call through again")
        assert answer(core, "back", case) == expected  # its success closed the breaker
        assert breaker.num_failures == 0

        proxy.mode = CUT  # the first reply is cut after its first chunk: a tier stopped mid-load
        assert answer(core, "cut", case) == 0
        report = tiers.report()
        assert report.stats.unavailable["shared"] >= 2 and report.stats.corrupt["shared"] == 0
    finally:
        proxy.mode = PASS
        core.close()
