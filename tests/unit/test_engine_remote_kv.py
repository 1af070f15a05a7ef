"""Prefill on one engine, decode on another: the engine-level handoff (export, reserve, install, resume),
on the fake runner, whose tokens depend on the KV it reads back.

A prefill engine exports a prompt's KV after the first token; a decode engine reserves blocks, installs
that KV and decodes on. The tokens must equal one engine doing both, and every block must come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from services.engine.kv_export import KVExport, KVTransferError
from tests.engine_fakes import fake_runner, make_fake_engine
from tests.engine_helpers import drain, generate, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = {
    "short": [5, 9, 13, 2, 7],
    "blocks": [(i * 7) % 120 + 2 for i in range(70)],  # several 16-token blocks and a partial one
}


def engine_for() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4)


def prefill(engine: EngineCore, request_id: str, prompt: Sequence[int], params: SamplingParams,
            skip: int) -> tuple[TokenLogprob, KVExport]:  # fmt: skip
    engine.add_request(request_id, prompt, params, export_kv_from=skip)
    outputs = [out for out in drain(engine)]
    assert len(outputs) == 1 and outputs[0].kv is not None and outputs[0].finish_reason is None
    logprob = outputs[0].logprobs[0].logprob if outputs[0].logprobs else 0.0
    return TokenLogprob(outputs[0].new_token_ids[0], logprob), outputs[0].kv


def assert_idle(engine: EngineCore) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks.num_active == 0
    engine.check_invariants()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_handoff_decodes_the_same_tokens_as_one_engine(name: str) -> None:
    prompt = PROMPTS[name]
    want = generate(engine_for(), {"r": prompt}, GREEDY)["r"]
    producer, consumer = engine_for(), engine_for()
    skip = consumer.reserve_remote("r", prompt, GREEDY)
    assert skip == 0
    first, export = prefill(producer, "r", prompt, GREEDY, skip)
    assert export.start_token == 0 and export.kv.shape[1] == len(prompt)
    assert_idle(producer)  # the prefill replica keeps nothing active (its blocks stay cached)
    consumer.install_remote("r", first, export)
    got = [first.token_id, *run_to_completion(consumer)["r"]]
    assert got == want
    assert_idle(consumer)
    # The decode side computed no prompt position: every decode step starts after the prompt.
    assert all(start >= len(prompt) for start, _ in fake_runner(consumer).computed_for(("r", 0)))


def test_seeded_sampling_continues_identically_after_the_handoff() -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = PROMPTS["blocks"]
    want = generate(engine_for(), {"r": prompt}, params)["r"]
    producer, consumer = engine_for(), engine_for()
    first, export = prefill(producer, "r", prompt, params, consumer.reserve_remote("r", prompt, params) or 0)
    consumer.install_remote("r", first, export)
    assert [first.token_id, *run_to_completion(consumer)["r"]] == want


def test_cached_prefix_on_the_decode_side_is_not_sent_again() -> None:
    prompt = PROMPTS["blocks"]
    producer, consumer = engine_for(), engine_for()
    generate(consumer, {"warm": prompt}, GREEDY)  # the decode replica now caches the prompt's blocks
    skip = consumer.reserve_remote("r", prompt, GREEDY)
    assert skip == (len(prompt) - 1) // 16 * 16 == 64
    first, export = prefill(producer, "r", prompt, GREEDY, skip)
    assert export.start_token == 64 and export.kv.shape[1] == len(prompt) - 64
    consumer.install_remote("r", first, export)
    want = generate(engine_for(), {"r": prompt}, GREEDY)["r"]
    assert [first.token_id, *run_to_completion(consumer)["r"]] == want
    assert_idle(consumer)
    [installed] = fake_runner(consumer).kv_writes
    assert (installed.start, installed.end) == (64, len(prompt))


@pytest.mark.parametrize("first_went_out", [False, True])
def test_resume_local_recomputes_and_continues_the_same_stream(first_went_out: bool) -> None:
    prompt = PROMPTS["blocks"]
    want = generate(engine_for(), {"r": prompt}, GREEDY)["r"]
    consumer = engine_for()
    consumer.reserve_remote("r", prompt, GREEDY)
    first = TokenLogprob(want[0], 0.0) if first_went_out else None
    consumer.resume_local("r", first)
    got = run_to_completion(consumer)["r"]
    assert ([want[0], *got] if first_went_out else got) == want
    assert_idle(consumer)


def test_wrong_kv_is_refused_and_the_reservation_still_frees() -> None:
    prompt = PROMPTS["blocks"]
    producer, consumer = engine_for(), engine_for()
    consumer.reserve_remote("r", prompt, GREEDY)
    first, export = prefill(producer, "r", prompt, GREEDY, 0)
    short = KVExport(0, export.kv[:, :-3])
    with pytest.raises(KVTransferError):
        consumer.install_remote("r", first, short)
    with pytest.raises(KVTransferError):
        consumer.install_remote("r", first, KVExport(16, export.kv[:, 16:]))
    assert consumer.stats().kv_blocks.num_active > 0
    consumer.abort(["r"])
    assert_idle(consumer)


def test_no_room_reserves_nothing() -> None:
    consumer = make_fake_engine(kv_cache_memory_mb=1, max_model_len=512)
    total = consumer.stats().kv_blocks.num_total
    long_prompt = [(i % 100) + 2 for i in range(400)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reserved = [consumer.reserve_remote(f"r{i}", long_prompt, params) for i in range(total // 26 + 2)]
    assert reserved[-1] is None
    held = sum(1 for r in reserved if r is not None)
    consumer.abort([f"r{i}" for i in range(held)])
    assert_idle(consumer)


def test_first_token_that_ends_the_request_exports_nothing() -> None:
    producer = engine_for()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    producer.add_request("r", PROMPTS["short"], params, export_kv_from=0)
    (output,) = drain(producer)
    assert output.kv is None and output.finish_reason is not None
    assert_idle(producer)


def test_a_request_without_a_reservation_takes_no_kv() -> None:
    consumer = engine_for()
    export = KVExport(0, fake_runner(engine_for()).read_kv([], 0, 0))
    with pytest.raises(KVTransferError, match="no KV reservation"):
        consumer.install_remote("nope", TokenLogprob(3, 0.0), export)
    with pytest.raises(KVTransferError, match="no KV reservation"):
        consumer.resume_local("nope", None)
    consumer.end_reserved("nope", FinishReason.LENGTH)  # nothing to free: a no-op
    assert_idle(consumer)
