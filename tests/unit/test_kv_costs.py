"""Fetch or recompute (services/kvcache/costs.py): a tier measured slower than the engine's prefill is not
asked, one probe per interval re-measures it, and a fast probe brings it back at once. Time is a fake
clock; measurements are fed in as observations."""

from __future__ import annotations

from services.kvcache.costs import MIN_PREFILL_TOKENS, FetchCosts
from services.kvcache.tier_set import SegmentSize, TierSet
from tests.unit.test_kv_tier_set import KEYS, DictTier, check

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def costs_with_prefill(seconds_per_token: float, clock: Clock) -> FetchCosts:
    costs = FetchCosts(probe_interval_s=5.0, clock=clock)
    costs.observe_step(1000, 1000 * seconds_per_token)
    return costs


def test_every_tier_is_asked_until_there_is_something_to_compare() -> None:
    costs = FetchCosts(clock=Clock())
    assert costs.should_ask("shared", MB, 256)  # nothing measured at all
    costs.observe_call("shared", 10.0, MB)  # a very slow tier, but no prefill measured yet
    assert costs.should_ask("shared", MB, 256)
    costs.observe_step(MIN_PREFILL_TOKENS - 1, 0.001)  # a decode-sized step says nothing about prefill
    assert costs.should_ask("shared", MB, 256)
    assert costs.recompute_instead == {}


def test_a_tier_slower_than_recompute_is_skipped_and_probed_once_per_interval() -> None:
    clock = Clock()
    costs = costs_with_prefill(0.001, clock)  # 256 tokens: 0.256 s to recompute
    costs.observe_call("shared", 0.002, 0)  # a miss: its latency
    costs.observe_call("shared", 0.01, MB)  # a hit: about 100 MB/s
    assert costs.should_ask("shared", MB, 256)  # 0.01 s to fetch beats 0.256 s
    for _ in range(10):
        costs.observe_call("shared", 2.0, MB)  # it slows down: 2 s per segment
    assert costs.should_ask("shared", MB, 256)  # the first skip would be a probe: none happened yet
    costs.observe_call("shared", 2.0, MB)  # the probe was slow too
    assert not costs.should_ask("shared", MB, 256)
    assert not costs.should_ask("shared", MB, 256)
    assert costs.recompute_instead["shared"] == 2
    clock.now += 5.0  # a probe is due
    assert costs.should_ask("shared", MB, 256)
    costs.observe_call("shared", 0.01, MB)  # it is fast again: the probe's measurement replaces the average
    assert costs.should_ask("shared", MB, 256)
    assert costs.recompute_instead["shared"] == 2


def test_the_estimate_is_latency_plus_bytes_over_bandwidth() -> None:
    clock = Clock()
    costs = costs_with_prefill(0.001, clock)
    costs.observe_call("disk", 0.05, 0)  # 50 ms to find nothing
    costs.observe_call("disk", 0.05 + 0.1, 10 * MB)  # 100 ms more for 10 MB: 100 MB/s
    tiers, _ = costs.snapshot()
    estimate = tiers["disk"].estimate(MB)
    assert estimate is not None and abs(estimate - 0.06) < 1e-9
    assert tiers["disk"].bytes_per_s is not None and abs(tiers["disk"].bytes_per_s - 100 * MB) < 1
    assert costs.should_ask("disk", MB, 100)  # 0.06 s against 0.1 s of recompute
    assert costs.should_ask("disk", 4 * MB, 100)  # 0.09 s
    assert costs.should_ask("disk", 10 * MB, 100)  # 0.15 s: slower, but the first probe is due
    assert not costs.should_ask("disk", 10 * MB, 100)
    assert costs.should_ask("disk", 10 * MB, 1000)  # against 1 s of recompute


class SlowTier(DictTier):
    """A dict tier whose every call takes `delay` seconds of the fake clock."""

    def __init__(self, name: str, clock: Clock, delay: float) -> None:
        super().__init__(name)
        self.clock = clock
        self.delay = delay

    def get(self, key: str) -> bytes | None:
        self.clock.now += self.delay
        return super().get(key)


def test_the_tier_set_skips_a_slow_tier_for_the_next_one_until_a_probe_finds_it_fast() -> None:
    clock = Clock()
    slow, fast = SlowTier("shared", clock, 2.0), DictTier("disk")
    slow.values[KEYS[0]] = fast.values[KEYS[0]] = b"good0"
    costs = costs_with_prefill(0.001, clock)  # 32 tokens: 32 ms to recompute
    tiers = TierSet([slow, fast], costs=costs, clock=clock)
    size = SegmentSize(num_bytes=5, num_tokens=32)

    def fetch() -> None:
        assert tiers.fetch(KEYS[:1], check, float("inf"), size) == [b"0"]

    fetch()  # not measured yet: asked, 2 s
    fetch()  # measured slow, but a probe is due: asked, 2 s again
    assert (slow.num_calls, fast.num_calls) == (2, 0)
    fetch()  # skipped: the disk serves it
    assert (slow.num_calls, fast.num_calls) == (2, 1)
    assert tiers.report().recompute_instead == {"shared": 1}
    clock.now += 5.0
    slow.delay = 0.0  # fast again
    fetch()  # the probe measures it fast
    fetch()  # and it is asked as usual
    assert (slow.num_calls, fast.num_calls) == (4, 1)
    report = tiers.report()
    assert report.stats.hits == {"shared": 4, "disk": 1}
    assert report.stats.fetch_seconds_sum["shared"] == 4.0
