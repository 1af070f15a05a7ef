"""The router counts a replica's queue by priority class: a request waits only behind its own class and
the ones above it (real router, fake replicas reporting `waiting_by_priority`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common import priority
from services.common.config import DisaggregationConfig, RouterConfig
from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.replicas import ReplicaSet
from services.router.router_service import RouterService
from tests.router_fakes import FakeReplica, FakeServer, serve_router, start_fake

FINGERPRINT = "fp-priority"


@pytest.fixture
def pool() -> Iterator[dict[str, FakeServer]]:
    """Replica a has 12 low-class requests waiting, replica b 4 normal ones and a high one."""
    fakes = {name: start_fake(FakeReplica(FINGERPRINT)) for name in ("a", "b")}
    fakes["a"].replica.load = pb.LoadResponse(ready=True, waiting=12, waiting_by_priority={priority.LOW: 12})
    by_class = {priority.NORMAL: 4, priority.HIGH: 1}
    fakes["b"].replica.load = pb.LoadResponse(ready=True, waiting=5, waiting_by_priority=by_class)
    yield fakes
    for fake in fakes.values():
        fake.stop()


async def routed_to(pool: dict[str, FakeServer], classes: list[int]) -> list[str]:
    replica_set = ReplicaSet([f.address for f in pool.values()], TokenSource("t"), watch_kv_events=False)
    await replica_set.refresh()
    service = RouterService(replica_set, DisaggregationConfig(policy="never"), RouterConfig())
    router = await serve_router(service)
    try:
        params = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=3))
        for i, klass in enumerate(classes):
            request = pb.GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=[2, 3, 4], sampling=params, priority=klass
            )
            await router.generate(request)
    finally:
        await router.close()
        await replica_set.close()
    calls = [(call.request_id, name) for name, f in pool.items() for call in f.replica.generate_calls]
    return [name for _, name in sorted(calls)]


async def test_a_request_is_not_counted_behind_a_lower_classes_queue(pool: dict[str, FakeServer]) -> None:
    # high and normal: nothing ahead on a (its 12 are low), 1 and 5 on b; low: 12 ahead on a, 5 on b
    assert await routed_to(pool, [priority.NORMAL, priority.HIGH, priority.LOW]) == ["a", "a", "b"]


async def test_a_worker_without_classes_counts_its_whole_queue(pool: dict[str, FakeServer]) -> None:
    del pool["a"].replica.load.waiting_by_priority[priority.LOW]  # a reports its 12 as a plain count
    assert await routed_to(pool, [priority.HIGH, priority.NORMAL]) == ["b", "b"]
