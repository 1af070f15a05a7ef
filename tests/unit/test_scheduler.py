"""Scheduler and KV accounting on plain data: a fake model samples tokens; invariants after every step."""

from __future__ import annotations

import random

import pytest

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


HIGH, NORMAL, LOW = -1, 0, 1  # services/common/priority.py's classes


def test_a_high_class_arrival_runs_next_step_and_takes_a_low_class_requests_blocks() -> None:
    s = make(6, budget=64)
    s.add(req("low-a", [1] * 8, max_tokens=8, priority=LOW, t=0.0))  # 2 blocks, a third to decode
    s.add(req("low-b", [2] * 8, max_tokens=8, priority=LOW, t=1.0))
    run_step(s)
    run_step(s)  # both decode: 6 blocks held, none free
    assert s.kv.pool.num_available == 0
    s.add(req("urgent", [3] * 5, max_tokens=2, priority=HIGH, t=2.0))
    step = run_step(s)
    assert step.chunks[0].request.parent_id == "urgent"
    assert [s.requests[i].parent_id for i in step.preempted_ids] == ["low-b"]  # the newest of the class
    assert {c.request.parent_id for c in step.chunks} == {"urgent", "low-a"}
    while s.has_work():
        run_step(s)
    assert s.kv.pool.stats().num_active == 0


def test_no_lower_class_is_admitted_while_a_higher_class_request_waits() -> None:
    s = make(5, budget=64)
    s.add(req("high-running", [1] * 12, max_tokens=8, priority=HIGH, t=0.0))  # 3 blocks, a 4th to decode
    run_step(s)
    s.add(req("high-waiting", [2] * 9, max_tokens=2, priority=HIGH, t=1.0))  # 3 blocks: does not fit
    s.add(req("low", [3] * 2, max_tokens=2, priority=LOW, t=2.0))  # 1 block: would fit
    step = run_step(s)
    assert [c.request.parent_id for c in step.chunks] == ["high-running"]
    assert not step.preempted_ids  # a request of its own class is never taken from
    finished_order = []
    while s.has_work():
        for c in run_step(s).chunks:
            if c.request.is_finished:
                finished_order.append(c.request.parent_id)
    assert finished_order.index("high-waiting") < finished_order.index("low")


def test_a_higher_class_takes_the_step_budget_from_a_lower_class_prefill() -> None:
    s = make(64, budget=8)
    s.add(req("low-long", list(range(100, 140)), max_tokens=2, priority=LOW))
    run_step(s)  # its first chunk of 8
    s.add(req("high", [1, 2, 3], max_tokens=4, priority=HIGH, t=1.0))
    step = run_step(s)
    by_id = {c.request.parent_id: c.num_new_tokens for c in step.chunks}
    assert by_id == {"high": 3, "low-long": 5}  # the high class first, the low prefill gets the rest


@pytest.mark.parametrize("classes", [(NORMAL,), (HIGH, NORMAL, LOW)])
def test_random_mix_of_finishes_aborts_and_preemptions_never_leaks(classes: tuple[int, ...]) -> None:
    rng = random.Random(1)
    s = make(12, budget=16, max_seqs=6)
    live: list[str] = []
    for i in range(300):
        if rng.random() < 0.6:
            rid = f"r{i}"
            prompt = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 14))]
            s.add(req(rid, prompt, max_tokens=rng.randrange(1, 24), priority=rng.choice(classes), t=float(i)))
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


def test_no_lower_class_request_is_preempted_when_all_of_them_would_not_make_room() -> None:
    s = make(10, budget=64)
    s.add(req("high-run", [1] * 20, max_tokens=4, priority=HIGH, t=0.0))  # 5 blocks, a 6th to decode
    s.add(req("low-a", [2] * 7, max_tokens=4, priority=LOW, t=1.0))  # 2 blocks, its next token fits
    s.add(req("low-b", [3] * 6, max_tokens=4, priority=LOW, t=2.0))  # likewise
    run_step(s)  # 9 of 10 blocks held
    s.add(req("high-wait", [4] * 24, max_tokens=2, priority=HIGH, t=3.0))  # 6 blocks: the lows free only 4
    step = run_step(s)  # high-run takes the last free block
    assert not step.preempted_ids and "high-wait" not in {c.request.parent_id for c in step.chunks}
    assert s.num_preemptions == 0
