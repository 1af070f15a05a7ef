"""Router policies on plain data: cost estimates, bounded randomisation, session affinity, P/D choice."""

from __future__ import annotations

import collections
import random

import pytest

from services.router.disaggregation import TransferModel, decide
from services.router.policy import (
    AffinityRing,
    Candidate,
    Choice,
    CostModel,
    CostPolicy,
    LeastLoaded,
    RendezvousAffinity,
    RoundRobin,
)

COSTS = CostModel(prefill_tokens_per_s=1000.0, per_running_seq_s=0.002, assumed_waiting_prompt_tokens=256)


def policy(seed: int = 0) -> CostPolicy:
    return CostPolicy(COSTS, rng=random.Random(seed))


def test_prefers_the_replica_holding_the_prompt_prefix() -> None:
    hot = Candidate("a", cached_tokens=960)
    cold = Candidate("b")
    choice = policy().choose([cold, hot], num_prompt_tokens=1000)
    assert choice is not None and choice.name == "a" and choice.reason == "prefix_overlap"


def test_a_deep_queue_outweighs_a_cache_hit() -> None:
    hot_but_busy = Candidate("a", cached_tokens=500, queued_tokens=4000, in_flight=8)
    idle = Candidate("b")
    choice = policy().choose([hot_but_busy, idle], num_prompt_tokens=600)
    assert choice is not None and choice.name == "b"


def test_equal_replicas_share_the_load_instead_of_herding() -> None:
    candidates = [Candidate(name) for name in "abcd"]
    chosen = collections.Counter()
    p = policy(seed=7)
    for _ in range(400):
        choice = p.choose(candidates, num_prompt_tokens=100)
        assert choice is not None
        chosen[choice.name] += 1
    assert set(chosen) == set("abcd") and min(chosen.values()) > 60


def test_cost_counts_queue_prefill_and_decode_terms() -> None:
    c = Candidate("a", in_flight=2, waiting=1, running=10, queued_tokens=500, cached_tokens=200)
    assert COSTS.queue_s(c) == (500 + 256) / 1000
    assert COSTS.prefill_s(c, 1200) == 1.0
    assert COSTS.decode_s(c) == 12 * 0.002


def test_round_robin_and_least_loaded_stay_available() -> None:
    rr = RoundRobin()
    names = [rr.choose([Candidate("b"), Candidate("a")], 10) for _ in range(4)]
    assert [c.name for c in names if c] == ["a", "b", "a", "b"]
    busy, free = Candidate("a", in_flight=3), Candidate("b", in_flight=1)
    pick = LeastLoaded().choose([busy, free], 10)
    assert pick is not None and pick.name == "b"
    assert policy().choose([], 10) is None


def test_affinity_is_stable_per_session_and_spreads_sessions() -> None:
    ring = AffinityRing()
    candidates = [Candidate("a"), Candidate("b"), Candidate("c")]
    picks = {}
    for i in range(60):
        first = ring.choose(f"session-{i}", candidates)
        again = ring.choose(f"session-{i}", candidates)
        assert first is not None and again is not None and first.name == again.name
        assert first.reason == "session_placed" and again.reason == "session_affinity"
        picks[i] = first.name
    counts = collections.Counter(picks.values())
    assert max(counts.values()) <= 25  # ceil(1.25 x 60 / 3): the bound holds, however the keys hash


def test_few_sessions_on_two_replicas_stay_within_the_bound() -> None:
    for seed in range(20):
        ring = AffinityRing(load_factor=1.25)
        candidates = [Candidate("a"), Candidate("b")]
        homes = collections.Counter()
        for i in range(12):
            choice = ring.choose(f"seed{seed}-s{i}", candidates)
            assert choice is not None
            homes[choice.name] += 1
        assert max(homes.values()) <= 8 and min(homes.values()) >= 4


def test_affinity_yields_one_request_when_its_replica_is_swamped() -> None:
    ring = AffinityRing(load_factor=1.25)
    idle = [Candidate("a"), Candidate("b")]
    home = ring.choose("s", idle)
    assert home is not None
    loaded = [Candidate(c.name, in_flight=20 if c.name == home.name else 0) for c in idle]
    assert ring.choose("s", loaded) is None  # the cost policy places this request
    back = ring.choose("s", idle)
    assert back is not None and back.name == home.name  # the session keeps its home
    assert ring.choose("", idle) is None


def test_sessions_move_only_when_their_replica_leaves_and_idle_ones_are_forgotten() -> None:
    ring = AffinityRing(idle_s=10.0)
    two = [Candidate("a"), Candidate("b")]
    homes = {i: ring.choose(f"s{i}", two, now=0.0) for i in range(30)}
    survivors = [Candidate("a")]
    for i, home in homes.items():
        moved = ring.choose(f"s{i}", survivors, now=1.0)
        assert home is not None and moved is not None and moved.name == "a"
        assert moved.reason == ("session_affinity" if home.name == "a" else "session_placed")
    ring.choose("late", two, now=100.0)  # everyone else idle past 10 s
    assert list(ring._homes) == ["late"]


def test_shared_affinity_is_the_same_on_every_router_and_spreads_sessions() -> None:
    """Two routers (two instances, sessions seen in opposite orders) home every session alike."""
    candidates = [Candidate("a"), Candidate("b"), Candidate("c")]
    first, second = RendezvousAffinity(), RendezvousAffinity()
    homes = {i: first.choose(f"session-{i}", candidates) for i in range(300)}
    for i in reversed(range(300)):
        again = second.choose(f"session-{i}", list(reversed(candidates)))
        assert again is not None and again == homes[i] and again.reason == "session_affinity"
    counts = collections.Counter(h.name for h in homes.values() if h is not None)
    assert min(counts.values()) >= 70  # about 100 each: the hash spreads keys


def test_shared_affinity_moves_only_the_sessions_of_a_replica_that_leaves_or_joins() -> None:
    affinity = RendezvousAffinity()
    three = [Candidate("a"), Candidate("b"), Candidate("c")]
    before = {i: affinity.choose(f"s{i}", three) for i in range(200)}
    two = [Candidate("a"), Candidate("b")]
    for i, home in before.items():
        now = affinity.choose(f"s{i}", two)
        assert home is not None and now is not None
        assert now.name == home.name or home.name == "c"  # only c's sessions moved
    four = [*three, Candidate("d")]
    for i, home in before.items():
        now = affinity.choose(f"s{i}", four)
        assert home is not None and now is not None and now.name in (home.name, "d")


def test_shared_affinity_passes_an_overloaded_home_over_for_one_request() -> None:
    affinity = RendezvousAffinity(load_factor=1.25)
    idle = [Candidate("a"), Candidate("b")]
    home = affinity.choose("s", idle)
    assert home is not None
    other = "b" if home.name == "a" else "a"
    # 1.25 x mean 10 + 4 = 16.5: the home's 20 reported requests are over, the other's 0 are not
    loaded = [Candidate(home.name, running=8, waiting=12), Candidate(other)]
    assert affinity.choose("s", loaded) == Choice(other, "session_overflow")
    assert affinity.choose("s", idle) == home  # back home once the load drops
    assert affinity.choose("", idle) is None


def test_shared_affinity_hashes_addresses_so_the_listing_order_does_not_matter() -> None:
    """Static discovery names replicas by their place in --workers: two routers listing the same workers
    in another order still agree, since the address is what is hashed."""
    one = [Candidate("worker-0", address="10.0.0.1:50051"), Candidate("worker-1", address="10.0.0.2:50051")]
    other = [Candidate("worker-0", address="10.0.0.2:50051"), Candidate("worker-1", address="10.0.0.1:50051")]
    affinity = RendezvousAffinity()
    for i in range(50):
        a, b = affinity.choose(f"s{i}", one), affinity.choose(f"s{i}", other)
        assert a is not None and b is not None
        assert {c.name: c.address for c in one}[a.name] == {c.name: c.address for c in other}[b.name]


TRANSFER = TransferModel(kv_bytes_per_token=46080, bytes_per_s=1e9)


def test_disaggregation_reasons_that_need_no_estimate() -> None:
    d = Candidate("d")
    assert decide(100, 1, 0, None, d, COSTS, TRANSFER).reason == "no_prefill_pool"
    assert decide(100, 2, 0, Candidate("p"), d, COSTS, TRANSFER).reason == "multiple_samples"
    assert decide(100, 1, 512, Candidate("p"), d, COSTS, TRANSFER).reason == "short_prompt"


def test_idle_decode_prefills_locally_and_a_busy_one_ships_it_out() -> None:
    p = Candidate("p")
    idle = decide(2000, 1, 0, p, Candidate("d"), COSTS, TRANSFER)
    assert not idle.remote and idle.reason == "local_cheaper"
    busy = decide(2000, 1, 0, p, Candidate("d", running=24), COSTS, TRANSFER)
    assert busy.remote and busy.reason == "remote_cheaper"
    assert busy.remote_ttft_s is not None and busy.local_ttft_s is not None


def test_a_prefix_held_by_decode_keeps_the_prefill_local() -> None:
    p = Candidate("p")
    warm = Candidate("d", running=24, cached_tokens=1984)
    assert not decide(2000, 1, 0, p, warm, COSTS, TRANSFER).remote


def test_an_encoder_decoder_source_is_prefill_work_and_travels_as_encoder_output() -> None:
    """A T5-base-like request: one decoder token, a source of 2,000. The source is prefill work on either
    side (not a short prompt), and what travels is its encoder output (768 x 4 bytes a token), not the
    cross KV a decoder-only reading of the bytes would price (46,080 a token here)."""
    t5 = TransferModel(kv_bytes_per_token=46080, bytes_per_s=1e9, encoder_bytes_per_token=3072)
    p, d = Candidate("p"), Candidate("d", running=24)
    assert decide(1, 1, 512, p, d, COSTS, t5, num_source_tokens=2000).reason != "short_prompt"
    remote = decide(1, 1, 0, p, d, COSTS, t5, num_source_tokens=2000)
    as_kv = decide(2001, 1, 0, p, d, COSTS, t5)
    assert remote.remote and remote.remote_ttft_s is not None and as_kv.remote_ttft_s is not None
    shipped_s = 2000 * (46080 - 3072) / 1e9  # the cross KV's bytes over the encoder output's
    assert as_kv.remote_ttft_s - remote.remote_ttft_s == pytest.approx(shipped_s, rel=1e-6)
