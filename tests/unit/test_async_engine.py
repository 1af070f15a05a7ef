"""The async client over the core, on the fake runner: streams, closing early aborts, abort by ID ends
the open stream, and `launch` builds and steps the core on one thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from services.common.errors import DuplicateRequestError, EmptyPromptError
from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineCore, EngineStats
from tests.engine_fakes import make_fake_engine
from tests.engine_helpers import run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def small_engine(step_seconds: float = 0.0) -> EngineCore:
    return make_fake_engine(
        kv_cache_memory_mb=4, max_num_batched_tokens=32, block_size=8, step_seconds=step_seconds
    )


async def wait_for_stats(
    client: AsyncEngine, condition: Callable[[EngineStats], bool], what: str, timeout: float = 10.0
) -> EngineStats:
    deadline = time.monotonic() + timeout
    while not condition(stats := client.stats()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s: {stats}")
        await asyncio.sleep(0.01)
    return stats


async def test_async_stream_yields_tokens_and_closing_early_aborts() -> None:
    # A millisecond a forward, as a tiny model takes: the abort must land long before the request ends.
    engine = small_engine(step_seconds=0.001)
    client = AsyncEngine(engine)
    client.start()
    try:
        # a consumer that lags gets several steps' tokens in one output (async_engine._coalesce): count all
        tokens = [t async for o in client.generate("a", [4, 5, 6], GREEDY) for t in o.new_token_ids]
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


async def test_abort_by_id_ends_every_sample_of_the_open_stream() -> None:
    client = AsyncEngine(small_engine(step_seconds=0.001))
    client.start()
    try:
        params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=400, ignore_eos=True)
        stream = client.generate("x", [4, 5, 6], params)
        first = await anext(stream)
        client.abort("x")  # as Worker.Abort does, while the stream is still read
        async with asyncio.timeout(10):  # without the ends the stream would wait for 400 tokens' steps
            rest = [o async for o in stream]
        ends = {o.index: o.finish_reason for o in [first, *rest] if o.finished}
        assert ends == {0: FinishReason.ABORT, 1: FinishReason.ABORT}
        assert all(o.request_id == "x" for o in rest)
        await wait_for_stats(client, lambda s: s.kv_blocks.num_active == 0, "the blocks' return")
        assert client.stats().num_aborted == 1
    finally:
        client.shutdown()


async def test_a_duplicate_id_is_refused_and_the_running_stream_keeps_its_tokens() -> None:
    client = AsyncEngine(small_engine(step_seconds=0.001))
    client.start()
    try:
        stream = client.generate("same", [4, 5, 6], GREEDY)
        first = await anext(stream)
        with pytest.raises(DuplicateRequestError):
            await anext(client.generate("same", [7, 8, 9], GREEDY))
        rest = [o async for o in stream]
        tokens = [t for o in [first, *rest] for t in o.new_token_ids]  # an output may carry several
        assert len(tokens) == 12 and rest[-1].finish_reason == FinishReason.LENGTH
    finally:
        client.shutdown()


async def test_launch_builds_and_steps_the_core_on_one_thread_and_matches_the_core() -> None:
    """One thread does all the engine's torch work (one libgomp pool: see AsyncEngine.launch)."""
    expected = small_engine()
    expected.add_request("a", [4, 5, 6], GREEDY)
    want = run_to_completion(expected)["a"]
    threads: list[threading.Thread] = []

    def build() -> EngineCore:
        threads.append(threading.current_thread())
        return small_engine()

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
