"""The engine's monotonic totals: requests aborted while live and tokens sampled, on the fake runner."""

from __future__ import annotations

import asyncio
from typing import cast

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineCore
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.worker.counters import TransferCounters
from services.worker.metrics import WorkerMetrics
from services.worker.worker_service import WorkerService
from tests.engine_fakes import make_fake_engine
from tests.engine_helpers import run_to_completion

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def engine() -> EngineCore:
    return make_fake_engine(kv_cache_memory_mb=4, block_size=8)


def step_tokens(engine: EngineCore, num_steps: int) -> int:
    return sum(len(o.new_token_ids) for _ in range(num_steps) for o in engine.step())


def test_a_finished_request_counts_its_tokens_and_no_abort(engine: EngineCore) -> None:
    engine.add_request("done", [4, 5, 6], LONG)
    outputs = run_to_completion(engine)
    stats = engine.stats()
    assert len(outputs["done"]) == 40
    assert stats.num_generated_tokens == 40
    assert stats.num_aborted == 0


def test_a_reservation_the_first_token_finished_frees_its_blocks_without_an_abort(engine: EngineCore) -> None:
    """Decode side: the prefill replica's first token already ended the request (max_tokens 1, or EOS)."""
    assert engine.reserve_remote("one", list(range(2, 30)), LONG) == 0
    assert engine.stats().kv_blocks.num_active > 0
    engine.end_reserved("one", FinishReason.LENGTH)
    stats = engine.stats()
    assert stats.num_aborted == 0 and stats.num_generated_tokens == 0
    assert stats.num_running == 0 and stats.kv_blocks.num_active == 0
    engine.check_invariants()


def test_aborting_mid_generation_counts_one_abort_and_only_the_tokens_sampled(engine: EngineCore) -> None:
    engine.add_request("cut", [4, 5, 6], LONG)
    num_sampled = step_tokens(engine, 5)
    assert num_sampled == 5
    assert engine.abort(["cut"]) == 1
    stats = engine.stats()
    assert stats.num_aborted == 1
    assert stats.num_generated_tokens == 5 < LONG.max_tokens
    assert stats.num_running == 0 and stats.kv_blocks.num_active == 0


def test_an_abort_that_finds_nothing_live_is_not_counted(engine: EngineCore) -> None:
    engine.add_request("short", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    run_to_completion(engine)
    assert engine.abort(["short"]) == 0  # already finished
    assert engine.abort(["never-seen"]) == 0
    engine.add_request("twice", [4, 5, 6], LONG)
    assert engine.abort(["twice"]) == 1
    assert engine.abort(["twice"]) == 0  # a second abort (e.g. the router's Abort after a cancel)
    assert engine.stats().num_aborted == 1


def test_waiting_and_parallel_requests_count_once_each(engine: EngineCore) -> None:
    engine.add_request("queued", list(range(2, 40)), LONG)  # aborted before its first step
    engine.add_request(
        "par", [7, 8, 9], SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=20, ignore_eos=True)
    )
    assert engine.abort(["queued"]) == 1
    num_sampled = step_tokens(engine, 3)
    assert engine.abort(["par"]) == 3  # every sample of the request
    stats = engine.stats()
    assert stats.num_aborted == 2  # one per request, not one per sample
    assert stats.num_generated_tokens == num_sampled > 0
    assert stats.kv_blocks.num_active == 0


def test_worker_load_and_metrics_report_the_engine_totals(engine: EngineCore) -> None:
    engine.add_request("whole", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    run_to_completion(engine)
    engine.add_request("cut", [4, 5, 6], LONG)
    num_cut = step_tokens(engine, 3)
    engine.abort(["cut"])
    client = AsyncEngine(engine)  # not started: its stats snapshot is the core's, taken now
    service = WorkerService(client, pb.InfoResponse())
    load = asyncio.run(service.Load(pb.LoadRequest(), cast(grpc.aio.ServicerContext, None)))
    assert load.requests_aborted_total == 1
    assert load.generation_tokens_total == 7 + num_cut
    metrics = WorkerMetrics("colocated", "w0")
    metrics.watch(client, TransferCounters())
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
    }
    assert values["kvrelay_worker_aborted_requests_total"] == 1
    assert values["kvrelay_worker_generation_tokens_total"] == 7 + num_cut
