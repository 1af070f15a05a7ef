"""The router's view of the tiers below the pools (services/router/tier_index.py), fed KV events by hand:
segments found chain from the pool's hit as a worker's lookup does; the shared tier is every replica's and
ages out; a replica's own tiers are its alone and go with its event stream. And what the cost policy makes
of it (policy.py): a prefix one fetch away is cheaper than recompute and dearer than the pool, and a busy
home yields a returning session to a replica that can fetch its prefix."""

from __future__ import annotations

import random
from dataclasses import replace

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.policy import Candidate, Choice, CostModel, CostPolicy, home_is_busy
from services.router.tier_index import TierIndex

HASHES = [bytes([i]) * 32 for i in range(12)]  # a prompt of 12 blocks
SEGMENT = 4  # blocks


def segment(tier: str, first: int, end: int, ttl_s: int = 60) -> pb.TierSegment:
    return pb.TierSegment(
        tier=tier, block_hash=HASHES[end - 1], first_block=first, num_blocks=end - first, ttl_s=ttl_s
    )


UP = ("host", "disk", "shared")


def test_whole_segments_chain_from_the_pools_hit_then_the_longest_tail_asked_for() -> None:
    index = TierIndex()
    assert index.below_blocks("a", HASHES, 0, UP) == 0  # nothing reported yet
    index.apply("a", [segment("shared", 0, 4), segment("shared", 4, 8), segment("shared", 8, 10)], [])
    assert index.below_blocks("a", HASHES, 0, UP) == 8  # two segments; the tail [8, 10) is not asked for
    assert index.below_blocks("a", HASHES, 0, UP, tail_ends={10, 11}) == 10  # asked again: found
    assert index.below_blocks("b", HASHES, 0, UP, {10}) == 10  # the shared tier is every replica's
    assert index.below_blocks("b", HASHES, 6, UP) == 8  # from the boundary below the pool's hit
    assert index.below_blocks("b", HASHES, 11, UP) == 11  # the pool holds more: nothing below counts
    assert index.below_blocks("b", HASHES, 0, ("host", "disk")) == 0  # b's shared tier is down
    index.apply("b", [], [segment("shared", 4, 8)])  # dropped (evicted): the run stops before it
    assert index.below_blocks("a", HASHES, 0, UP) == 4
    assert index.below_blocks("a", HASHES[:7], 0, UP) == 4  # a segment past the prompt is no use


def test_a_replicas_own_tiers_are_its_alone_per_tier_and_go_with_its_event_stream() -> None:
    index = TierIndex()
    index.apply("a", [segment("disk", 0, 4), segment("host", 0, 4), segment("host", 4, 8)], [])
    assert (index.below_blocks("a", HASHES, 0, UP), index.below_blocks("b", HASHES, 0, UP)) == (8, 0)
    index.apply("a", [], [segment("host", 0, 4)])  # the host tier evicted it; the disk still has it
    assert index.below_blocks("a", HASHES, 0, UP) == 8
    assert index.below_blocks("a", HASHES, 0, ("host",)) == 0  # its disk tier is down
    index.forget("a")
    assert index.below_blocks("a", HASHES, 0, UP) == 0


def test_a_shared_segment_ages_out_after_its_lifetime_and_a_longer_write_extends_it() -> None:
    now = [100.0]
    index = TierIndex(clock=lambda: now[0])
    index.apply("a", [segment("shared", 0, 4, ttl_s=300)], [])
    index.apply("b", [segment("shared", 0, 4, ttl_s=60)], [])  # a shorter write does not shorten it
    now[0] = 350.0
    assert index.below_blocks("a", HASHES, 0, UP) == 4
    now[0] = 401.0
    assert index.below_blocks("a", HASHES, 0, UP) == 0
    index.expire()
    assert not index.shared


def test_tokens_one_fetch_away_cost_less_than_recompute_and_more_than_the_pool() -> None:
    model = CostModel(prefill_tokens_per_s=1000.0)
    pool = Candidate("pool", cached_tokens=900)
    below = Candidate("below", below_tokens=900, below_s_per_token=0.0002)
    cold = Candidate("cold")
    costs = [model.cost_s(c, 1000) for c in (pool, below, cold)]
    assert costs[0] < costs[1] < costs[2]
    assert CostPolicy(model, rng=random.Random(0)).choose([below, cold], 1000) == Choice(
        "below", "tier_overlap", costs[1]
    )


def test_a_busy_home_yields_to_a_replica_that_fetches_the_session_from_below() -> None:
    model = CostModel(prefill_tokens_per_s=1000.0)
    home = Candidate("home", waiting=8, cached_tokens=900)  # 8 prompts queued ahead: about 2 s
    idle_below = Candidate("other", below_tokens=896, below_s_per_token=0.0002)
    idle_cold = Candidate("other")
    assert home_is_busy(home, [home, idle_below], model, 1000)
    assert not home_is_busy(home, [home, idle_cold], model, 1000)  # no tier knowledge: stay home
    assert not home_is_busy(replace(home, waiting=0), [home, idle_below], model, 1000)  # home is not busy
