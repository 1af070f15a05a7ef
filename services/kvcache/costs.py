"""Fetch or recompute: what the tiers cost, learned while serving, against what the engine's prefill costs.

For each tier, two moving averages: the time a call takes when it finds nothing (its latency) and the time
per byte of a hit beyond that latency (its bandwidth, inverted). A segment of `n` bytes is expected to cost
`latency + n * seconds_per_byte` to fetch. Recomputing it costs its tokens times the engine's measured
seconds per prompt token, taken from steps that batch at least `MIN_PREFILL_TOKENS` tokens (a decode step's
cost per token says nothing about a prefill's). A tier expected to be slower than recompute is not asked
(`recompute_instead` counts it), except once per `probe_interval_s`: a probe's measurement replaces the
averages, so a tier that is fast again is used again at once. Until the engine has a measurement, and for a
tier never measured, every tier is asked.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

MIN_PREFILL_TOKENS = 64
ALPHA = 0.3  # weight of a new sample in a moving average


@dataclass
class TierCost:
    """What one tier has been measured to cost (None: not measured yet)."""

    latency_s: float | None = None
    seconds_per_byte: float | None = None
    last_probe: float = float("-inf")

    def estimate(self, num_bytes: int) -> float | None:
        if self.latency_s is None and self.seconds_per_byte is None:
            return None
        return (self.latency_s or 0.0) + num_bytes * (self.seconds_per_byte or 0.0)

    @property
    def bytes_per_s(self) -> float | None:
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte else None


def _blend(old: float | None, sample: float, replace: bool) -> float:
    return sample if old is None or replace else old + ALPHA * (sample - old)


class FetchCosts:
    """Thread-safe: the engine thread observes steps, lookup threads ask and observe calls."""

    def __init__(self, probe_interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.probe_interval_s = probe_interval_s
        self.clock = clock
        self.tiers: dict[str, TierCost] = {}
        self.prefill_s_per_token: float | None = None
        self.recompute_instead: Counter[str] = Counter()
        self._probing: set[str] = set()
        self._lock = threading.Lock()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """An engine step of `num_tokens` batched tokens took `seconds`."""
        if num_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            self.prefill_s_per_token = _blend(self.prefill_s_per_token, seconds / num_tokens, False)

    def should_ask(self, tier: str, num_bytes: int, num_tokens: int) -> bool:
        """Whether fetching `num_bytes` (the KV of `num_tokens` tokens) from `tier` beats recomputing them;
        False is counted as a recompute-instead decision. A due probe is allowed (and timed as one)."""
        with self._lock:
            cost = self.tiers.setdefault(tier, TierCost())
            estimate = cost.estimate(num_bytes)
            if estimate is None or self.prefill_s_per_token is None:
                return True
            if estimate <= num_tokens * self.prefill_s_per_token:
                return True
            now = self.clock()
            if now - cost.last_probe >= self.probe_interval_s:
                cost.last_probe = now
                self._probing.add(tier)
                return True
            self.recompute_instead[tier] += 1
            return False

    def observe_call(self, tier: str, seconds: float, num_bytes: int) -> None:
        """A call to `tier` took `seconds` and returned `num_bytes` (0: a miss)."""
        with self._lock:
            cost = self.tiers.setdefault(tier, TierCost())
            probe = tier in self._probing
            self._probing.discard(tier)
            if num_bytes == 0:
                cost.latency_s = _blend(cost.latency_s, seconds, probe)
                return
            beyond = max(seconds - (cost.latency_s or 0.0), 0.0)
            cost.seconds_per_byte = _blend(cost.seconds_per_byte, beyond / num_bytes, probe)
            if probe and cost.latency_s is not None:
                cost.latency_s = min(cost.latency_s, seconds)

    def snapshot(self) -> tuple[dict[str, TierCost], dict[str, int]]:
        """Each tier's measured cost, and how many segments each was not asked for (recompute instead)."""
        with self._lock:
            tiers = {name: replace(cost) for name, cost in self.tiers.items()}
            return tiers, dict(self.recompute_instead)
