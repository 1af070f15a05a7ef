"""Replica choice, as pure code over plain data: no I/O, no clocks, randomness injected.

`CostPolicy` estimates, for each candidate, how long this request would take to get its first token
there, plus what it would cost the streams already running there:

    queue_s   = tokens queued ahead of it (prompts the router dispatched and not yet started, plus the
                replica's own waiting count at an assumed prompt size) / prefill rate
    prefill_s = prompt tokens the replica neither holds in its prefix cache nor finds in the tiers below it
                / prefill rate + those it finds below x its fetch time per token
    decode_s  = running streams x the time one more sequence adds to a decode step

and picks at random among the candidates within `slack` of the cheapest (bounded randomisation: equal
replicas share the load instead of herding to one). `RoundRobin` and `LeastLoaded` stay for comparison.

Session affinity, two ways (`router.affinity`). `RendezvousAffinity` (`shared`, the chart's) ranks the
live replicas for a session by rendezvous hashing and takes the first whose reported load is within the
bound: a pure function of the session key, the live set and the load the replicas report, so every router
replica computes the same home without talking to the others. `AffinityRing` (`local`) places a new
session by consistent hashing with bounded load counted in the sessions this router has seen, and keeps it
there (the default): tighter balance with one router, but two routers place a session each on their own.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    name: str
    in_flight: int = 0  # requests this router sent there and has not seen finish
    waiting: int = 0  # the replica's own queue, from its last load report
    running: int = 0  # from its last load report
    queued_tokens: int = 0  # prompt tokens this router dispatched there whose first token has not come
    cached_tokens: int = 0  # leading prompt tokens this replica holds in its prefix cache
    below_tokens: int = 0  # prompt tokens after those that the tiers below its pool hold for it
    below_s_per_token: float = 0.0  # what fetching one of them costs there (the workers' measured rate)
    address: str = ""  # host:port: what shared affinity hashes (static names follow the --workers order)

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str
    cost_s: float | None = None


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Choice | None: ...


@dataclass
class RoundRobin:
    _turn: int = 0

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Choice | None:
        if not candidates:
            return None
        pick = sorted(candidates, key=lambda c: c.name)[self._turn % len(candidates)]
        self._turn += 1
        return Choice(pick.name, "round_robin")


@dataclass
class LeastLoaded:
    """Fewest outstanding requests (our own in-flight count plus the replica's queue); ties rotate."""

    _turn: int = 0

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Choice | None:
        if not candidates:
            return None
        self._turn += 1
        n = len(candidates)
        ordered = sorted(enumerate(candidates), key=lambda ic: (ic[1].load, (ic[0] - self._turn) % n))
        return Choice(ordered[0][1].name, "least_loaded")


@dataclass(frozen=True)
class CostModel:
    """Rates for the estimates. The defaults fit SmolLM2 on a few CPU cores; GPU pools set their own."""

    prefill_tokens_per_s: float = 1000.0
    per_running_seq_s: float = 0.002  # what one more running sequence adds to a decode step
    assumed_waiting_prompt_tokens: int = 256  # a queued request the router knows only by count

    def queue_s(self, c: Candidate) -> float:
        tokens = c.queued_tokens + c.waiting * self.assumed_waiting_prompt_tokens
        return tokens / self.prefill_tokens_per_s

    def prefill_s(self, c: Candidate, num_prompt_tokens: int) -> float:
        computed = max(0, num_prompt_tokens - c.cached_tokens - c.below_tokens) / self.prefill_tokens_per_s
        return computed + c.below_tokens * c.below_s_per_token

    def decode_s(self, c: Candidate) -> float:
        return (c.running + c.in_flight) * self.per_running_seq_s

    def cost_s(self, c: Candidate, num_prompt_tokens: int) -> float:
        return self.queue_s(c) + self.prefill_s(c, num_prompt_tokens) + self.decode_s(c)


@dataclass
class CostPolicy:
    model: CostModel = field(default_factory=CostModel)
    slack_s: float = 0.005  # candidates this close to the cheapest are equals
    slack_ratio: float = 0.1
    rng: random.Random = field(default_factory=random.Random)

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Choice | None:
        if not candidates:
            return None
        costs = [(self.model.cost_s(c, num_prompt_tokens), c) for c in candidates]
        best = min(cost for cost, _ in costs)
        bound = best + max(self.slack_s, best * self.slack_ratio)
        near = [(cost, c) for cost, c in costs if cost <= bound]
        cost, pick = self.rng.choice(near)
        reason = "lowest_cost"
        if len(near) < len(costs) and (pick.cached_tokens or pick.below_tokens):
            reason = "prefix_overlap" if pick.cached_tokens else "tier_overlap"
        return Choice(pick.name, reason, cost)


HOME_YIELD_RATIO = 2.0  # a session's home this many times dearer than another replica ...
HOME_YIELD_SLACK_S = 0.1  # ... plus this, where that one finds the prefix below its pool: leave home


def home_is_busy(
    home: Candidate, candidates: Sequence[Candidate], model: CostModel, num_prompt_tokens: int
) -> bool:
    """Whether a returning session should leave its home for this request: another replica can fetch its
    prefix from the tiers below its pool, and would answer far sooner than home, whose queue is long."""
    others = [c for c in candidates if c.name != home.name and c.below_tokens]
    if not others:
        return False
    best = min(model.cost_s(c, num_prompt_tokens) for c in others)
    return model.cost_s(home, num_prompt_tokens) > HOME_YIELD_RATIO * best + HOME_YIELD_SLACK_S


SWAMP_SLACK = 4


@dataclass
class AffinityRing:
    """Sessions placed by consistent hashing with bounded load, then kept where they were placed.

    A new session walks the ring from its key's point and takes the first replica holding fewer than
    ceil(load_factor x active sessions / replicas) sessions (Mirrokni et al.'s bound, counted in sessions,
    so no replica ends up with more than load_factor times its share even with few sessions). Later
    requests of the session go to that replica while it is a candidate and not swamped right now
    (this router's requests in flight there above overload_factor x (the least busy candidate's + 4)):
    then this request alone is left to the cost policy (None), and the session keeps its home.
    Sessions idle for `idle_s` are forgotten. `now` is injected so the policy stays free of clocks.
    """

    virtual_nodes: int = 64
    load_factor: float = 1.25
    overload_factor: float = 4.0
    idle_s: float = 600.0
    _points: list[tuple[int, str]] = field(default_factory=list)
    _names: tuple[str, ...] = ()
    _homes: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)  # LRU first

    def choose(self, session_key: str, candidates: Sequence[Candidate], now: float = 0.0) -> Choice | None:
        if not session_key or not candidates:
            return None
        self._forget_idle(now)
        by_name = {c.name: c for c in candidates}
        home = self._homes.get(session_key)
        if home is None or home[0] not in by_name:
            name = self._place(session_key, tuple(sorted(by_name)))
            reason = "session_placed"
        else:
            name, reason = home[0], "session_affinity"
        self._homes[session_key] = (name, now)
        self._homes.move_to_end(session_key)
        # Swamped: more than overload_factor x (the least busy candidate's requests in flight + SWAMP_SLACK),
        # from this router's own counts (never stale, and not counted twice as reported queues would be).
        busy_bound = self.overload_factor * (min(c.in_flight for c in candidates) + SWAMP_SLACK)
        if by_name[name].in_flight > busy_bound:
            return None  # its home is swamped right now: the cost policy places this request
        return Choice(name, reason)

    def _place(self, session_key: str, names: tuple[str, ...]) -> str:
        self._rebuild(names)
        held = {name: 0 for name in names}
        for home, _ in self._homes.values():
            if home in held:
                held[home] += 1
        capacity = math.ceil(self.load_factor * (sum(held.values()) + 1) / len(names))
        start = bisect.bisect(self._points, (_point(session_key), ""))
        for i in range(len(self._points)):
            name = self._points[(start + i) % len(self._points)][1]
            if held[name] < capacity:
                return name
        return min(names, key=lambda n: held[n])

    def _forget_idle(self, now: float) -> None:
        while self._homes:
            key, (_, seen) = next(iter(self._homes.items()))
            if now - seen <= self.idle_s:
                return
            del self._homes[key]

    def _rebuild(self, names: tuple[str, ...]) -> None:
        if names == self._names:
            return
        self._names = names
        self._points = sorted(
            (_point(f"{name}#{v}"), name) for name in names for v in range(self.virtual_nodes)
        )


OVERFLOW_SLACK = 4  # requests over the bound's mean share before a home is passed over


@dataclass
class RendezvousAffinity:
    """Sessions homed by rendezvous (highest-random-weight) hashing over the live candidates, with a load
    bound, agreed by every router replica without shared state.

    Each candidate scores hash(session key, replica address): the same on every router whatever order
    its replicas were listed in; the session's home is the highest score, so a replica joining or leaving
    moves only the sessions it wins or held. A home whose reported load (running + waiting, from its own
    load reports, which every router reads alike) is over load_factor x the mean + OVERFLOW_SLACK is
    passed over for this request, to the next in the session's order, which is also the same on every
    router; the session returns home once the load drops. The least loaded candidate is always within
    the bound, so there is a choice whenever there is a key. Stateless: `now` is unused.
    """

    load_factor: float = 1.25

    def choose(self, session_key: str, candidates: Sequence[Candidate], now: float = 0.0) -> Choice | None:
        if not session_key or not candidates:
            return None
        ranked = sorted(
            candidates,
            key=lambda c: (_point(f"{session_key}\x00{c.address or c.name}"), c.address, c.name),
            reverse=True,
        )
        reported = [c.running + c.waiting for c in candidates]
        bound = self.load_factor * sum(reported) / len(reported) + OVERFLOW_SLACK
        for rank, c in enumerate(ranked):
            if c.running + c.waiting <= bound:
                return Choice(c.name, "session_affinity" if rank == 0 else "session_overflow")
        return None


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
