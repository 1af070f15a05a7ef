"""Abort at any point, parallel sampling, and the async client, on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.errors import EmptyPromptError
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineCore, EngineStats
from services.engine.request import FinishReason
from tests.engine_helpers import make_engine, run_to_completion
from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(tiny_dir: Path) -> EngineCore:
    return make_engine(tiny_dir, "float32", kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 4, 8])
def test_abort_mid_prefill_or_mid_decode_returns_every_block(
    engine: EngineCore, abort_after_steps: int
) -> None:
    engine.add_request("long", list(range(2, 100)), GREEDY)  # 98 tokens: 4 chunks of 32
    engine.add_request("short", [5, 6, 7], GREEDY)
    for _ in range(abort_after_steps):
        engine.step()
        engine.check_invariants()
    assert engine.abort(["long", "short"]) == 2  # neither has finished: short needs 12 steps
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_aborted == 2
    assert stats.kv_blocks.num_active == 0
    assert stats.num_running == stats.num_waiting == 0


def finish_reasons(engine: EngineCore, prompt: list[int], params: SamplingParams) -> list[FinishReason]:
    engine.add_request("c", prompt, params)
    reasons = []
    while engine.has_work():
        reasons += [o.finish_reason for o in engine.step() if o.finish_reason is not None]
    return reasons


def test_stop_token_ends_with_stop_and_max_tokens_with_length(engine: EngineCore) -> None:
    engine.add_request("probe", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = run_to_completion(engine)["probe"][0]
    length = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert finish_reasons(engine, [5, 6, 7], length) == [FinishReason.LENGTH]
    stop = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(first,))
    assert finish_reasons(engine, [5, 6, 7], stop) == [FinishReason.STOP]


def test_parallel_samples_share_the_prompt_blocks(engine: EngineCore) -> None:
    prompt = list(range(2, 60))  # 7 full blocks of 8
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=6, ignore_eos=True)
    engine.add_request("par", prompt, params)
    shared_seen = 0
    while engine.has_work():
        engine.step()
        engine.check_invariants()
        refs = engine.scheduler.held_block_refs()
        shared_seen = max(shared_seen, sum(1 for n in refs.values() if n == 4))
    assert shared_seen >= 7  # every full prompt block held by all four samples at once
    assert engine.stats().kv_blocks.num_active == 0


def test_parallel_samples_with_a_seed_differ_from_each_other(engine: EngineCore) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    engine.add_request("p", [4, 5, 6], params)
    outs = run_to_completion(engine)
    assert len({tuple(outs[k]) for k in ("p", "p#1", "p#2")}) == 3


async def wait_for_stats(
    client: AsyncEngine, condition: Callable[[EngineStats], bool], what: str, timeout: float = 10.0
) -> EngineStats:
    deadline = time.monotonic() + timeout
    while not condition(stats := client.stats()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s: {stats}")
        await asyncio.sleep(0.01)
    return stats


async def test_async_stream_yields_tokens_and_closing_early_aborts(engine: EngineCore) -> None:
    client = AsyncEngine(engine)
    client.start()
    try:
        tokens = [o.new_token_ids[0] async for o in client.generate("a", [4, 5, 6], GREEDY)]
        assert len(tokens) == 12
        prompt = list(range(2, 90))
        max_tokens = engine.max_model_len - len(prompt)  # as long as the context allows
        stream = client.generate("b", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        await anext(stream)
        await stream.aclose()  # the client went away
        stats = await wait_for_stats(
            client,
            lambda s: s.num_aborted == 1 and s.num_running == 0 and s.kv_blocks.num_active == 0,
            "the abort of the closed stream",
        )
        num_generated = stats.num_generated_tokens - len(tokens)
        assert 0 < num_generated < max_tokens // 2, f"{num_generated} of {max_tokens}: not stopped early"
        with pytest.raises(EmptyPromptError):
            await anext(client.generate("c", [], GREEDY))
    finally:
        client.shutdown()


async def test_launch_builds_and_steps_the_core_on_one_thread_and_matches_the_core(tiny_dir: Path) -> None:
    """One thread does all the engine's torch work (one libgomp pool: see AsyncEngine.launch)."""
    expected = make_engine(tiny_dir, "float32", kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)
    expected.add_request("a", [4, 5, 6], GREEDY)
    want = run_to_completion(expected)["a"]
    threads: list[threading.Thread] = []

    def build() -> EngineCore:
        threads.append(threading.current_thread())
        return make_engine(tiny_dir, "float32", kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8)

    client = AsyncEngine.launch(build)
    client.start()  # already running: a no-op, not a second loop
    try:
        assert threads == [client._thread] and threads[0] is not threading.current_thread()
        got = [t async for o in client.generate("a", [4, 5, 6], GREEDY) for t in o.new_token_ids]
        assert got == want
        assert client.is_alive
    finally:
        client.shutdown()


def test_launch_passes_a_build_error_to_the_caller() -> None:
    def build() -> EngineCore:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.launch(build)
