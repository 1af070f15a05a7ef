"""Overlapped steps (`engine.overlap`, core.py) on the fake runner: step t+1 is launched before step t's
tokens are read back, with t's tokens fed to t+1 as placeholders the runner fills in; the outputs equal
the plain loop's, and every block comes back, through stops, aborts, preemption, n > 1 and a prefill
replica's handoff. The fake computes at launch, so what is checked is the order of work and the result.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_fakes import fake_runner, make_fake_engine
from tests.engine_helpers import drain

PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 120 + 2 for j in range(4 + 9 * i)] for i in range(6)}
# About one token in six stops a request: some end early, by a stop token only known once read back.
STOPS = tuple(range(100, 120))
MIXED = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=STOPS),
    "seeded": SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, stop_token_ids=STOPS),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, stop_token_ids=STOPS),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=STOPS),
    "n2": SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=10, stop_token_ids=STOPS),
    "long": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
}


def run(overlap: bool, **engine: Any) -> tuple[EngineCore, dict[tuple[str, int], tuple[list[int], Any]]]:
    core = make_fake_engine(overlap=overlap, **engine)
    for (request_id, prompt), params in zip(PROMPTS.items(), MIXED.values(), strict=True):
        core.add_request(request_id, prompt, params)
    seen: dict[tuple[str, int], tuple[list[int], Any]] = {}
    for out in drain(core):
        tokens, _ = seen.get((out.request_id, out.index), ([], None))
        seen[(out.request_id, out.index)] = (tokens + out.new_token_ids, out.finish_reason)
    stats = core.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks.num_active == 0
    return core, seen


def test_overlapped_steps_give_the_plain_loops_outputs() -> None:
    _, plain = run(False)
    _, overlapped = run(True)
    assert overlapped == plain
    reasons = [reason for _, reason in plain.values()]
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons, "both kinds of end were meant"


def test_step_t_plus_1_is_launched_before_step_t_is_read_back() -> None:
    plain, _ = run(False)
    events = fake_runner(plain).events
    assert events[:4] == [("launch", 1), ("collect", 1), ("launch", 2), ("collect", 2)]
    core, _ = run(True)
    events = fake_runner(core).events
    assert events[:5] == [("launch", 1), ("launch", 2), ("collect", 1), ("launch", 3), ("collect", 2)]
    launched = [n for kind, n in events if kind == "launch"]
    collected = [n for kind, n in events if kind == "collect"]
    assert collected == launched, "every launched step is read back once, in order"


def test_a_stop_token_costs_one_dropped_position_and_a_length_end_none() -> None:
    core = make_fake_engine(overlap=True)
    core.add_request(
        "stop", PROMPTS["r1"], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=STOPS)
    )
    core.add_request("len", PROMPTS["r2"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    outputs = drain(core)
    ends = {o.request_id: o for o in outputs if o.finish_reason is not None}
    assert (
        ends["stop"].finish_reason is FinishReason.STOP and ends["len"].finish_reason is FinishReason.LENGTH
    )
    runner = fake_runner(core)
    stop_tokens = sum(len(o.new_token_ids) for o in outputs if o.request_id == "stop")
    last_computed = max(end for _, end in runner.computed_for(("stop", 0)))
    assert last_computed == len(PROMPTS["r1"]) + stop_tokens, "the stop token's own KV was computed"
    last_computed = max(end for _, end in runner.computed_for(("len", 0)))
    assert last_computed == len(PROMPTS["r2"]) + 5 - 1, "nothing past a known last token"


def test_an_abort_while_its_step_is_in_flight_drops_that_step_and_frees_everything() -> None:
    core = make_fake_engine(overlap=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    core.add_request("a", PROMPTS["r3"], params)
    core.add_request("b", PROMPTS["r4"], params)
    first = core.step()  # launches step 1 only
    assert first == []
    core.step()  # launches step 2, reads back step 1
    assert core.abort(["a"]) == 1  # step 2 holds a's next token, in flight
    rest = drain(core)
    assert [o for o in rest if o.request_id == "a"] == []
    assert sum(len(o.new_token_ids) for o in rest if o.request_id == "b") == 29
    assert core.stats().kv_blocks.num_active == 0


def test_preemption_under_a_tight_cache_gives_the_plain_loops_outputs() -> None:
    """128 blocks of 16 tokens; eight requests of 150 + up to 150 tokens need 19 blocks each."""
    prompts = {f"r{i}": [(i * 31 + j * 7) % 120 + 2 for j in range(150)] for i in range(8)}
    params = [
        SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=150, ignore_eos=True),
    ]
    results = []
    for overlap in (False, True):
        core = make_fake_engine(overlap=overlap, kv_cache_memory_mb=1, max_model_len=512)
        for i, (request_id, prompt) in enumerate(prompts.items()):
            core.add_request(request_id, prompt, params[i % 2])
        outputs = drain(core)
        assert core.stats().num_preemptions >= 1 and core.stats().kv_blocks.num_active == 0
        tokens: dict[str, list[int]] = {}
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        results.append(tokens)
    assert results[1] == results[0]


@pytest.mark.parametrize("penalty", ["repetition_penalty", "frequency_penalty"])
def test_a_penalised_row_reads_its_tokens_back_before_the_next_launch(penalty: str) -> None:
    core = make_fake_engine(overlap=True)
    value = 1.3 if penalty == "repetition_penalty" else 0.5
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **{penalty: value})
    core.add_request("p", PROMPTS["r1"], params)
    drain(core)
    events = fake_runner(core).events
    assert events == [("launch", 1), ("collect", 1), ("launch", 2), ("collect", 2), ("launch", 3),
                      ("collect", 3), ("launch", 4), ("collect", 4)]  # fmt: skip


def test_a_prefill_replica_stops_at_its_first_token() -> None:
    core = make_fake_engine(overlap=True)
    core.add_request("h", PROMPTS["r5"], SamplingParams(temperature=0.0, max_tokens=8), export_kv_from=0)
    outputs = drain(core)
    assert len(outputs) == 1 and outputs[0].kv is not None
    assert max(end for _, end in fake_runner(core).computed_for(("h", 0))) == len(PROMPTS["r5"])
    assert core.stats().kv_blocks.num_active == 0


def test_a_prefill_replicas_pending_token_is_never_preempted_from_under_its_export() -> None:
    """Four long requests fill the pool while a lower-priority prefill replica's last chunk is launched:
    the sequences that must give way are the growing ones, not the one whose KV is about to ship."""
    exports = []
    for overlap in (False, True):
        core = make_fake_engine(overlap=overlap, kv_cache_memory_mb=1, max_model_len=2048,
                                max_num_batched_tokens=4096)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for j in range(4):
            core.add_request(f"q{j}", [(i * (j + 1) % 100) + 2 for i in range(400)], params)
        prompt = [(i % 90) + 3 for i in range(28 * 16)]
        core.add_request(
            "x", prompt, SamplingParams(temperature=0.0, max_tokens=8), priority=1, export_kv_from=0
        )
        outputs = drain(core)
        [export] = [o for o in outputs if o.request_id == "x"]
        assert export.kv is not None and export.kv.kv.shape[1] == len(prompt)
        assert core.stats().kv_blocks.num_active == 0
        exports.append((export.new_token_ids, export.kv.kv))
    assert exports[1][0] == exports[0][0] and bool((exports[1][1] == exports[0][1]).all())


def test_parallel_samples_under_a_tight_cache_give_the_plain_loops_outputs() -> None:
    prompts = {f"r{i}": [(i * 13 + j * 5) % 120 + 2 for j in range(150)] for i in range(5)}
    params = SamplingParams(n=3, temperature=0.8, seed=21, max_tokens=150, ignore_eos=True)
    results = []
    for overlap in (False, True):
        core = make_fake_engine(overlap=overlap, kv_cache_memory_mb=1, max_model_len=512)
        for request_id, prompt in prompts.items():
            core.add_request(request_id, prompt, params)
        seen: dict[tuple[str, int], list[int]] = {}
        for out in drain(core):
            seen.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        assert core.stats().num_preemptions >= 1 and core.stats().kv_blocks.num_active == 0
        results.append(seen)
    assert results[1] == results[0]
