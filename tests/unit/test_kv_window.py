"""Freeing KV blocks that fell out of every layer's sliding window, on plain data (no model)."""

from __future__ import annotations

from services.common.block_hash import BlockHasher, root_hash
from services.common.outputs import TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.scheduling.block_pool import NO_BLOCK, BlockPool
from services.engine.scheduling.kv_manager import KVCacheManager, PrefixCacheStats
from services.engine.scheduling.request import Request
from services.engine.scheduling.scheduler import Scheduler, SchedulerOutput

BLOCK = 4
ROOT = root_hash("window-model")


def make(window: int | None, num_blocks: int = 32, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BLOCK, PrefixCacheStats(), window=window)
    return Scheduler(kv, budget, 8)


def req(rid: str, prompt: list[int], max_tokens: int = 8, export_kv_from: int | None = None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, BlockHasher(ROOT, BLOCK), export_kv_from=export_kv_from)


def run_step(s: Scheduler) -> SchedulerOutput:
    step = s.schedule()
    s.update(step, {c.request.seq_id: TokenLogprob(7, 0.0) for c in step.chunks if c.samples})
    s.kv.pool.check_invariants(s.held_block_refs())
    return step


def test_blocks_before_the_next_querys_window_are_freed_and_stay_cached() -> None:
    s = make(window=6)
    r = req("r", list(range(100, 120)))  # 20 prompt tokens: 5 full blocks
    s.add(r)
    run_step(s)  # the prompt: the next query sits at 20 and sees keys 15.. (blocks 3 and 4 on)
    assert r.block_ids[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in r.block_ids[3:]
    stats = s.kv.pool.stats()
    assert stats.num_active == len(r.block_ids) - 3 and stats.num_cached == 3
    for _ in range(4):  # decode to 24 tokens: key 18 is the oldest still seen, in block 4
        run_step(s)
    assert r.num_computed_tokens == 24
    assert r.block_ids[:4] == [NO_BLOCK] * 4 and NO_BLOCK not in r.block_ids[4:]


def test_a_freed_prefix_is_still_a_full_prefix_hit() -> None:
    s = make(window=6)
    prompt = list(range(100, 120))
    s.add(req("first", prompt, max_tokens=2))
    while s.has_work():
        run_step(s)
    second = req("second", prompt, max_tokens=2)
    s.add(second)
    run_step(s)
    assert second.num_cached_tokens == 16  # every leading full block, the freed ones included
    while s.has_work():
        run_step(s)
    assert s.kv.pool.stats().num_active == 0


def test_nothing_is_freed_without_a_window_for_every_layer() -> None:
    s = make(window=None)
    r = req("r", list(range(100, 140)))
    s.add(r)
    run_step(s)
    assert NO_BLOCK not in r.block_ids


def test_a_prefill_replicas_request_keeps_its_prompt_kv_to_ship() -> None:
    s = make(window=6)
    r = req("r", list(range(100, 140)), export_kv_from=0)
    s.add(r)
    run_step(s)
    assert NO_BLOCK not in r.block_ids


def test_preempting_a_request_with_freed_blocks_frees_the_rest_once() -> None:
    s = make(window=6, num_blocks=12)
    r = req("r", list(range(100, 120)), max_tokens=20)
    s.add(r)
    run_step(s)
    assert NO_BLOCK in r.block_ids
    s._preempt(r)
    s.kv.pool.check_invariants(s.held_block_refs())
    assert r.block_ids == [] and s.kv.pool.stats().num_active == 0
    while s.has_work():
        run_step(s)
    assert s.kv.pool.stats().num_active == 0
