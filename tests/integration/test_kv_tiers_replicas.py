"""The shared KV tier across real processes: workers on the real model (fp32) over one cache Redis of its
own role (started as `kvrelay up` starts it, services/common/cache_redis.py), spoken to over gRPC.

A worker answers a fixture prompt for tenant A and writes its segments through; tenant B's identical
prompt finds none of them; the worker restarted, and a second replica, load A's prefix from the shared tier
and answer with the fixture's greedy tokens; a prefill replica loads it and ships it to a decode replica.
A cache that stops or misbehaves: tests/integration/test_kv_tier_faults_model.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.kvcache.segment import tenant_tag
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.integration.test_engine_identity import assert_matches, long_cases
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving, wait_until

pytestmark = pytest.mark.model

TOKEN = "kv-tiers-test-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
SEGMENT = 64
A, B, C = b"tenant-a", b"tenant-b", b"tenant-c"


class Workers:
    """Worker (and router) processes sharing one cache Redis; each started on a port of its own."""

    def __init__(self, model_dir: Path, logs: Path, cache_port: int) -> None:
        self.model_dir = model_dir
        self.logs = logs
        self.env = stack_env(
            TOKEN,
            KVRELAY_MODEL__DTYPE="float32",
            KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="256",
            KVRELAY_ENGINE__MAX_MODEL_LEN="4096",
            KVRELAY_KV_TIERS__SHARED_URL=f"redis://127.0.0.1:{cache_port}/0",
            KVRELAY_KV_TIERS__SEGMENT_TOKENS=str(SEGMENT),
            KVRELAY_KV_TIERS__FETCH_DEADLINE_MS="60000",  # tokens are checked here, not speed
            KVRELAY_DISAGGREGATION__POLICY="always",
            KVRELAY_DISAGGREGATION__TRANSFER_TIMEOUT_MS="240000",
        )
        self.procs: list[Proc] = []

    def start(self, name: str, role: str = "colocated") -> str:
        address = f"127.0.0.1:{free_port()}"
        argv = ["worker", "--model", str(self.model_dir), "--role", role, "--port", address.split(":")[1]]
        proc = Proc([*argv, "--threads", "1", "--name", name], self.env, self.logs / f"{name}.log")
        self.procs.append(proc)
        wait_serving(address, proc)
        return address

    def start_router(self, workers: list[str], *args: str) -> str:
        address = f"127.0.0.1:{free_port()}"
        argv = ["router", "--port", address.split(":")[1], "--workers", ",".join(workers), *args]
        proc = Proc(argv, self.env, self.logs / f"router-{address.split(':')[1]}.log")
        self.procs.append(proc)
        wait_serving(address, proc)
        wait_until(
            lambda: len(ready_roles(address)) == len(workers), 60, "the router seeing every replica ready"
        )
        return address

    def stop(self, address: str | None = None) -> None:
        for proc in list(self.procs):
            if address is None or f"--port {address.split(':')[1]}" in " ".join(proc.popen.args):  # type: ignore[arg-type]
                proc.stop()
                self.procs.remove(proc)


def generate(
    address: str, rid: str, case: dict[str, Any], salt: bytes, session: str = ""
) -> tuple[list[int], pb.GenerateResponse]:
    params = SamplingParams(temperature=0.0, max_tokens=len(case["output_token_ids"]), ignore_eos=True)
    request = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=case["prompt_token_ids"],
        sampling=sampling_to_proto(params),
        cache_salt=salt,
        session_key=session,
    )
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    tokens: list[int] = []
    last = pb.GenerateResponse()
    for response in stub.Generate(request, metadata=MD, timeout=300):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


def ready_roles(router: str) -> list[str]:
    status = worker_pb2_grpc.RouterStub(grpc.insecure_channel(router))
    return sorted(
        r.role for r in status.Replicas(pb.ReplicasRequest(), metadata=MD, timeout=10).replicas if r.ready
    )


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the router's Prometheus metrics, 0 when absent."""
    for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def load(address: str) -> pb.LoadResponse:
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    return stub.Load(pb.LoadRequest(), metadata=MD, timeout=10)


def shared(address: str) -> pb.KVTier:
    (tier,) = [t for t in load(address).kv_tiers if t.name == "shared"]
    return tier


@pytest.fixture(scope="module")
def case(model_dir: Path) -> dict[str, Any]:
    """The fixture's shortest prompt past 500 tokens: several segments, seconds to compute."""
    (shortest,) = long_cases(1)
    return shortest


@pytest.fixture(scope="module")
def cache_port() -> Iterator[int]:
    port = free_port()
    proc = start_cache_redis(port, maxmemory_mb=256)
    yield port
    stop_cache_redis(proc)


@pytest.fixture(scope="module")
def workers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, cache_port: int) -> Iterator[Workers]:
    running = Workers(model_dir, tmp_path_factory.mktemp("kv-tiers-logs"), cache_port)
    yield running
    running.stop()


def keys_of(cache_port: int, salt: bytes) -> list[bytes]:
    return list(redis.Redis(port=cache_port).scan_iter(f"kv1:*:{tenant_tag(salt)}:*"))


def test_restart_and_a_second_replica_load_a_tenants_prefix_and_answer_the_same(
    workers: Workers, cache_port: int, case: dict[str, Any]
) -> None:
    num_prompt = len(case["prompt_token_ids"])
    expected_cached = (num_prompt - 1) // SEGMENT * SEGMENT  # the last prompt token is always recomputed
    first = workers.start("first")
    tokens, last = generate(first, "a-cold", case, A)
    assert_matches(case, tokens)
    assert last.num_cached_tokens == 0
    # Every full segment of the prompt and the output (but the last sampled token) is written through.
    num_segments = (num_prompt + len(tokens) - 1) // SEGMENT
    wait_until(lambda: len(keys_of(cache_port, A)) == num_segments, 60, "tenant A's segments in the cache")
    assert keys_of(cache_port, B) == []

    tokens, last = generate(first, "b-cold", case, B)  # the same prompt, another tenant: nothing to read
    assert_matches(case, tokens)
    assert last.num_cached_tokens == 0
    assert shared(first).hits == 0

    workers.stop(first)  # a restart: an empty pool, the same cache
    restarted, second = workers.start("restarted"), workers.start("second")
    for address, rid in ((restarted, "a-restarted"), (second, "a-second")):
        tokens, last = generate(address, rid, case, A)
        assert_matches(case, tokens)
        assert last.num_cached_tokens == expected_cached, rid
        assert load(address).kv_tier_fetched_tokens_total == expected_cached, rid
        assert shared(address).hits == expected_cached // SEGMENT
    workers.stop(restarted)


def test_a_prefill_replica_loads_the_prefix_and_ships_it_to_decode(
    workers: Workers, cache_port: int, case: dict[str, Any]
) -> None:
    if not keys_of(cache_port, A):  # run alone: write tenant A's segments first
        colocated = workers.start("writer")
        generate(colocated, "a-writer", case, A)
        wait_until(lambda: len(keys_of(cache_port, A)) > 0, 60, "tenant A's segments in the cache")
        workers.stop(colocated)
    prefill, decode = workers.start("prefill", "prefill"), workers.start("decode", "decode")
    router = workers.start_router([prefill, decode])
    assert ready_roles(router) == ["decode", "prefill"]
    tokens, last = generate(router, "a-disaggregated", case, A)
    assert_matches(case, tokens)
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE
    assert (
        load(prefill).kv_tier_fetched_tokens_total == (len(case["prompt_token_ids"]) - 1) // SEGMENT * SEGMENT
    )
    workers.stop(router)
    workers.stop(prefill)
    workers.stop(decode)


def test_a_session_whose_replica_stopped_lands_on_the_other_which_fetches_its_prefix_from_the_shared_tier(
    workers: Workers, cache_port: int, case: dict[str, Any]
) -> None:
    """The router learns the shared tier's segments from the workers' KV events, and routes the session
    whose replica is gone to the other expecting its prefix one fetch away; the other fetches it."""
    num_prompt = len(case["prompt_token_ids"])
    expected_cached = (num_prompt - 1) // SEGMENT * SEGMENT
    one, two = workers.start("one"), workers.start("two")
    metrics_port = free_port()
    router = workers.start_router([one, two], "--metrics-port", str(metrics_port))
    tokens, last = generate(router, "c-first", case, C, session="session-c")
    assert_matches(case, tokens)
    assert last.num_cached_tokens == 0
    home, other = (one, two) if load(one).requests_total else (two, one)
    wait_until(
        lambda: metric(metrics_port, "kvrelay_router_tier_segments", tier="shared") >= num_prompt // SEGMENT,
        60,
        "the router knowing the session's segments in the shared tier",
    )
    workers.stop(home)
    wait_until(lambda: len(ready_roles(router)) == 1, 60, "the router seeing the session's replica gone")
    tokens, last = generate(router, "c-again", case, C, session="session-c")
    assert_matches(case, tokens)
    assert last.num_cached_tokens == expected_cached  # served from the shared tier, not recomputed
    assert load(other).kv_tier_fetched_tokens_total == expected_cached
    assert metric(metrics_port, "kvrelay_router_tier_tokens_total") == expected_cached  # what it expected
    workers.stop(router)
    workers.stop(other)
