"""Scheduler and KV accounting on plain data: a fake model samples tokens; invariants after every step."""

from __future__ import annotations

import random

from services.common.block_hash import BlockHasher, root_hash
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.kv_manager import KVCacheManager, PrefixCacheStats
from services.engine.scheduling.request import Request, SeqId
from services.engine.scheduling.scheduler import Scheduler, SchedulerOutput

BLOCK = 4
ROOT = root_hash("test-model")


def make(num_blocks: int, budget: int = 32, max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BLOCK, PrefixCacheStats())
    return Scheduler(kv, budget, max_seqs)


def req(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, t: float = 0.0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, BlockHasher(ROOT, BLOCK), priority=priority, arrival_time=t)


def fake_sample(step: SchedulerOutput, token: int = 7) -> dict[SeqId, TokenLogprob]:
    return {c.request.seq_id: TokenLogprob(token, 0.0) for c in step.chunks if c.samples}


def run_step(s: Scheduler) -> SchedulerOutput:
    step = s.schedule()
    s.update(step, fake_sample(step))
    s.kv.pool.check_invariants(s.held_block_refs())
    return step


def test_long_prompt_is_chunked_and_never_stalls_a_running_decode() -> None:
    s = make(64, budget=8)
    s.add(req("short", [1, 2, 3], max_tokens=10))
    run_step(s)  # short's prompt
    s.add(req("long", list(range(100, 130)), max_tokens=2, t=1.0))
    for _ in range(3):
        step = run_step(s)
        by_id = {c.request.parent_id: c.num_new_tokens for c in step.chunks}
        assert by_id["short"] == 1  # the decode runs every step
        assert by_id["long"] == 7  # the rest of the budget goes to the prefill chunk
        assert step.num_batched_tokens <= 8


def test_step_respects_the_sequence_cap() -> None:
    s = make(64, budget=100, max_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", [1, 2], t=float(i)))
    assert len(run_step(s).chunks) == 2


def test_preempts_newest_request_when_out_of_blocks_and_recomputes_it() -> None:
    s = make(4, budget=64)
    s.add(req("old", [1, 2, 3, 4, 5, 6, 7], max_tokens=6, t=0.0))  # 2 blocks, grows into a third
    s.add(req("new", [9, 9, 9, 9, 9], max_tokens=6, t=1.0))  # 2 blocks
    run_step(s)
    finished = {}
    for _ in range(40):
        if not s.has_work():
            break
        step = run_step(s)
        for c in step.chunks:
            if c.request.is_finished:
                finished[c.request.parent_id] = c.request
    assert s.num_preemptions >= 1
    assert set(finished) == {"old", "new"}
    assert finished["new"].num_preemptions >= 1
    assert all(r.finish_reason is FinishReason.LENGTH for r in finished.values())
    assert s.kv.pool.stats().num_active == 0


def test_prefix_hit_skips_cached_blocks_and_counts_tokens() -> None:
    s = make(32)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    s.add(req("a", prompt, max_tokens=1))
    while s.has_work():
        run_step(s)
    s.add(req("b", prompt, max_tokens=1))
    step = run_step(s)
    [chunk] = step.chunks
    assert chunk.start_position == 12
    assert chunk.num_new_tokens == 1
    assert s.kv.prefix_stats.num_hits == 12


def test_last_prompt_token_is_always_recomputed_on_a_full_hit() -> None:
    s = make(32)
    prompt = list(range(1, 13))  # exactly 3 blocks
    s.add(req("a", prompt, max_tokens=1))
    while s.has_work():
        run_step(s)
    s.add(req("b", prompt, max_tokens=1))
    [chunk] = run_step(s).chunks
    assert chunk.start_position == 8 and chunk.num_new_tokens == 4


def test_abort_at_any_point_returns_every_block() -> None:
    for abort_after in range(6):
        s = make(16, budget=6)
        s.add(req("x", list(range(1, 20)), max_tokens=5))
        for _ in range(abort_after):
            if s.has_work():
                run_step(s)
        for request in s.live_samples("x"):
            s.finish(request, FinishReason.ABORT)
        s.kv.pool.check_invariants(s.held_block_refs())
        assert s.kv.pool.stats().num_active == 0


def test_priority_orders_admission() -> None:
    s = make(64, budget=100, max_seqs=1)
    s.add(req("late-urgent", [1, 2], priority=-1, t=5.0))
    s.add(req("early", [1, 2], priority=0, t=0.0))
    [chunk] = run_step(s).chunks
    assert chunk.request.parent_id == "late-urgent"


def test_random_mix_of_finishes_aborts_and_preemptions_never_leaks() -> None:
    rng = random.Random(1)
    s = make(12, budget=16, max_seqs=6)
    live: list[str] = []
    for i in range(300):
        if rng.random() < 0.6:
            rid = f"r{i}"
            prompt = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 14))]
            s.add(req(rid, prompt, max_tokens=rng.randrange(1, 24), t=float(i)))
            live.append(rid)
        if live and rng.random() < 0.1:
            rid = live.pop(rng.randrange(len(live)))
            for request in s.live_samples(rid):
                s.finish(request, FinishReason.ABORT)
        if s.has_work():
            run_step(s)
    while s.has_work():
        run_step(s)
    assert s.num_preemptions > 0
    assert s.kv.pool.stats().num_active == 0
    s.kv.pool.check_invariants({})
