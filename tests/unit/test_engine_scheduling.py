"""The core's scheduling end to end on the fake runner: chunked prefill, prefix hits and preemption
change which positions are computed, never the tokens; invariants hold after every step."""

from __future__ import annotations

from itertools import pairwise

from services.common.sampling import SamplingParams
from tests.engine_fakes import fake_runner, make_fake_engine
from tests.engine_helpers import drain, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [(i * 7) % 120 + 2 for i in range(70)]  # 4 full blocks of 16 and 6 tokens
GREEDY_LONG = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)


def generate_alone(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    engine.add_request("alone", prompt, params)
    return run_to_completion(engine)["alone"]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)
    prompt = list(range(2, 100))  # 98 tokens
    engine.add_request("long", prompt, GREEDY)
    got = run_to_completion(engine)["long"]
    computed = fake_runner(engine).computed_for(("long", 0))
    assert computed[:4] == [(0, 32), (32, 64), (64, 96), (96, 98)]
    assert computed[4:] == [(p, p + 1) for p in range(98, 98 + GREEDY.max_tokens - 1)]
    assert got == generate_alone(prompt)


def test_a_decode_runs_every_step_while_another_prompt_prefills() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4, max_num_batched_tokens=16, block_size=8)
    engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # short's prompt
    engine.add_request("long", list(range(2, 50)), GREEDY)
    for _ in range(3):
        engine.step()
        engine.check_invariants()
    runner = fake_runner(engine)
    assert runner.computed_for(("short", 0))[1:4] == [(3, 4), (4, 5), (5, 6)]
    assert runner.computed_for(("long", 0))[:3] == [(0, 15), (15, 30), (30, 45)]  # the budget's rest


def test_prefix_hit_reuses_the_cached_blocks_and_computes_only_the_rest() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    engine.add_request("a", PROMPT, GREEDY)
    first = run_to_completion(engine)["a"]
    engine.add_request("b", PROMPT, GREEDY)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
        engine.check_invariants()
    runner = fake_runner(engine)
    a_prompt, b_prompt = runner.computed[0], runner.computed[len(runner.computed_for(("a", 0)))]
    assert (a_prompt.start, a_prompt.end) == (0, 70)
    assert (b_prompt.seq_id, b_prompt.start, b_prompt.end) == (("b", 0), 64, 70)
    assert b_prompt.block_ids[:4] == a_prompt.block_ids[:4]  # the same four blocks, not copies
    assert [t for o in outputs for t in o.new_token_ids] == first
    assert {o.num_cached_tokens for o in outputs} == {64}
    assert engine.stats().prefix_cache_hits == 64


def test_a_prefix_cached_under_another_extra_key_is_not_a_hit() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    engine.add_request("a", PROMPT, GREEDY, cache_salt=b"tenant-a")
    run_to_completion(engine)
    engine.add_request("b", PROMPT, GREEDY, cache_salt=b"tenant-b")
    run_to_completion(engine)
    assert fake_runner(engine).computed_for(("b", 0))[0] == (0, 70)
    assert engine.stats().prefix_cache_hits == 0


def test_no_prefix_hits_with_prefix_caching_off() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4, enable_prefix_caching=False)
    for request_id in ("a", "b"):
        engine.add_request(request_id, PROMPT, GREEDY)
        run_to_completion(engine)
    assert fake_runner(engine).computed_for(("b", 0))[0] == (0, 70)
    assert engine.stats().kv_blocks.num_cached == 0


def test_preemption_recomputes_a_request_and_gives_the_same_tokens() -> None:
    # 128 blocks of 16 tokens; eight requests of 150 + 150 tokens need 19 blocks each: the KV runs out
    # while they decode, so the newest are preempted and computed again.
    engine = make_fake_engine(kv_cache_memory_mb=1, max_model_len=512)
    prompts = {f"r{i}": [(i * 31 + j * 7) % 120 + 2 for j in range(150)] for i in range(8)}
    params = GREEDY_LONG
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    got = run_to_completion(engine)
    assert engine.stats().num_preemptions >= 1
    runner = fake_runner(engine)
    recomputed = [r for r in prompts if _restarts(runner.computed_for((r, 0)))]
    assert recomputed, "no request was computed again after a preemption"
    for request_id, prompt in prompts.items():
        assert got[request_id] == generate_alone(prompt, params), request_id
    assert engine.stats().kv_blocks.num_active == 0


def _restarts(ranges: list[tuple[int, int]]) -> bool:
    """Whether a later chunk starts before an earlier one ended: positions computed again."""
    return any(later[0] < earlier[1] for earlier, later in pairwise(ranges))


def test_a_core_over_the_fake_runner_reports_the_planned_pool() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=1, block_size=16)
    assert engine.stats().kv_blocks.num_total == engine.num_blocks == 128  # 1 MiB of 8 KiB blocks
    assert engine.max_model_len == 512  # the model's positions: no engine.max_model_len set
    assert (engine.weight_dtype, engine.kv_dtype) == (engine.runner.weight_dtype, engine.runner.kv_dtype)


def test_queue_times_are_taken_once_per_request_at_its_first_admission() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=1, max_model_len=512)
    for i in range(8):  # as in the preemption test: some are admitted again after a preemption
        engine.add_request(f"r{i}", [(i * 31 + j * 7) % 120 + 2 for j in range(150)], GREEDY_LONG)
    queue_times = []
    while engine.has_work():
        engine.step()
        queue_times += engine.take_queue_times()
    assert engine.stats().num_preemptions >= 1
    assert len(queue_times) == 8 and all(t >= 0 for t in queue_times)
    assert engine.take_queue_times() == []


def test_kv_events_report_the_blocks_cached_and_evicted_once_enabled() -> None:
    engine = make_fake_engine(kv_cache_memory_mb=4)
    engine.add_request("before", PROMPT, GREEDY)
    run_to_completion(engine)
    before = engine.cached_block_hashes()
    assert len(before) == (70 + 12 - 1) // 16  # full blocks of prompt and output, computed
    assert engine.take_kv_events() == []  # not recording yet
    engine.enable_kv_events()
    engine.add_request("after", [3, *PROMPT], GREEDY)
    run_to_completion(engine)
    stored = [e.block_hash for e in engine.take_kv_events() if e.kind == "stored"]
    assert len(stored) == (71 + 12 - 1) // 16 and not set(stored) & set(before)
    assert set(engine.cached_block_hashes()) == set(before) | set(stored)
    assert engine.reset_prefix_cache() and engine.cached_block_hashes() == []
    assert {e.kind for e in engine.take_kv_events()} == {"removed"}


def test_a_high_class_arrival_runs_in_the_next_step_preempting_a_low_class_request() -> None:
    """Six low-class requests hold 120 of the pool's 128 blocks; a high-class request that needs 13
    arrives: the next step computes its prompt, the newest low-class request gives up its blocks, and
    every request still gets the tokens it would get alone."""
    engine = make_fake_engine(kv_cache_memory_mb=1, max_model_len=512, max_num_batched_tokens=4096)
    prompts = {f"low{i}": [(i * 31 + j * 7) % 120 + 2 for j in range(320)] for i in range(6)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY, priority=1)
    outputs = engine.step()
    assert engine.stats().kv_blocks.num_free < 13 and engine.stats().num_preemptions == 0
    urgent = [(j * 5) % 120 + 2 for j in range(200)]
    engine.add_request("urgent", urgent, GREEDY, priority=-1)
    outputs += engine.step()
    engine.check_invariants()
    runner = fake_runner(engine)
    assert runner.computed_for(("urgent", 0)) == [(0, 200)]
    assert engine.stats().num_preemptions == 1
    got: dict[str, list[int]] = {}
    for out in outputs + drain(engine):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    # only the newest low-class request gave up its blocks, and was computed again
    assert [r for r in prompts if _restarts(runner.computed_for((r, 0)))] == ["low5"]
    assert got["urgent"] == generate_alone(urgent)
    for request_id, prompt in prompts.items():
        assert got[request_id] == generate_alone(prompt), request_id
    assert engine.stats().kv_blocks.num_active == 0
