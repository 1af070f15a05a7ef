"""The router's prefix index, built from each replica's KVEvents stream (fake replicas at the gRPC seam):
the first batch is a snapshot that replaces what the index held, later batches are applied in order with
`removed` before `stored`, a broken stream forgets the replica's blocks and a new stream re-snapshots;
and what the index holds steers the cost policy (tenant salt included)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from services.common.block_hash import hash_token_blocks, root_hash
from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.replicas import Replica, ReplicaSet
from services.router.router_service import RouterService
from tests.router_fakes import BREAK, FakeReplica, FakeServer, GenerateScript, serve_router, start_fake

FINGERPRINT = "fp-prefix-index"
BLOCK_SIZE = 16
A, B, C, D = (bytes([i]) * 8 for i in range(1, 5))


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.01)


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    servers = [start_fake(FakeReplica(FINGERPRINT, block_size=BLOCK_SIZE)) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def replicas(fakes: list[FakeServer]) -> AsyncIterator[ReplicaSet]:
    replica_set = ReplicaSet([f.address for f in fakes], TokenSource("t"))
    yield replica_set
    await replica_set.close()


async def index_becomes(replica: Replica, expected: set[bytes], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while replica.cached != expected:
        if time.monotonic() > deadline:
            pytest.fail(
                f"the index holds {sorted(replica.cached)}, not {sorted(expected)}, after {timeout} s"
            )
        await asyncio.sleep(0.01)


async def test_the_first_batch_is_a_snapshot_that_replaces_what_the_index_held(
    fakes: list[FakeServer], replicas: ReplicaSet
) -> None:
    replica = replicas.replicas[0]
    replica.cached = {D}  # left over: the snapshot says what the replica holds now
    await replicas.refresh()  # healthy: the router follows its KV events
    fakes[0].replica.events.put(pb.KVEventBatch(snapshot=True, stored=[A, B]))
    await index_becomes(replica, {A, B})


async def test_changes_apply_in_order_with_removed_before_stored(
    fakes: list[FakeServer], replicas: ReplicaSet
) -> None:
    replica, events = replicas.replicas[0], fakes[0].replica.events
    await replicas.refresh()
    events.put(pb.KVEventBatch(snapshot=True, stored=[A, B]))
    await index_becomes(replica, {A, B})
    events.put(pb.KVEventBatch(stored=[C]))
    await index_becomes(replica, {A, B, C})
    events.put(pb.KVEventBatch(removed=[A]))
    await index_becomes(replica, {B, C})
    # Evicted while scheduling a step and stored again when it completed: held.
    events.put(pb.KVEventBatch(removed=[C, B], stored=[C, D]))
    await index_becomes(replica, {C, D})
    assert replicas.replicas[1].cached == set()  # the other replica's index is its own


async def test_a_broken_stream_forgets_the_replica_and_a_new_stream_snapshots_again(
    fakes: list[FakeServer], replicas: ReplicaSet
) -> None:
    replica, fake = replicas.replicas[0], fakes[0].replica
    await replicas.refresh()
    fake.events.put(pb.KVEventBatch(snapshot=True, stored=[A, B]))
    await index_becomes(replica, {A, B})
    fake.events.put(BREAK)
    await until(lambda: replica.events_task is not None and replica.events_task.done(), "stream end")
    assert replica.cached == set(), "a broken stream must not leave stale blocks in the index"
    await replicas.refresh()  # the next good probe follows the events again
    await until(lambda: fake.num_event_streams == 2, "a second KVEvents stream")
    fake.events.put(pb.KVEventBatch(snapshot=True, stored=[C]))
    await index_becomes(replica, {C})


def request(prompt: list[int], salt: bytes = b"", request_id: str = "r") -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=3)
    return pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params), cache_salt=salt
    )


async def test_the_replica_holding_the_prompt_prefix_wins_for_its_tenant_only(
    fakes: list[FakeServer], replicas: ReplicaSet
) -> None:
    prompt = list(range(2, 2 + 10 * BLOCK_SIZE))
    held = hash_token_blocks(root_hash(FINGERPRINT), prompt, BLOCK_SIZE, b"tenant-a")[:8]
    await replicas.refresh()
    fakes[1].replica.events.put(pb.KVEventBatch(snapshot=True, stored=held))
    hot = replicas.replicas[1]
    await index_becomes(hot, set(held))
    service = RouterService(replicas)
    for i in range(20):
        hashes, block_size = replicas.prompt_block_hashes(prompt, b"tenant-a")
        route = service.route(request(prompt, b"tenant-a"), set(), hashes, block_size)
        assert route is not None and (route.decode.name, route.choice.reason) == (hot.name, "prefix_overlap")
        other_tenant = service.route(
            request(prompt, b"tenant-b"), set(), *replicas.prompt_block_hashes(prompt, b"tenant-b")
        )
        assert other_tenant is not None and other_tenant.choice.reason == "lowest_cost", i


async def test_a_queued_cache_hit_does_not_push_the_next_one_off_its_replica(
    fakes: list[FakeServer], replicas: ReplicaSet
) -> None:
    """Two follow-ups of sessions whose prefix one replica holds, the second sent while the first waits
    for its first token there: what the first queues is only its uncached part, so both stay."""
    system = list(range(2, 2 + 5 * BLOCK_SIZE))
    prompts = [system + [100 + s] * (3 * BLOCK_SIZE) + [120 + s] * 20 for s in range(2)]
    root = root_hash(FINGERPRINT)
    held = [h for p in prompts for h in hash_token_blocks(root, p, BLOCK_SIZE, b"")[:8]]
    for fake in fakes:
        fake.replica.script = GenerateScript(hold=threading.Event())
    hot, hot_fake = replicas.replicas[0], fakes[0].replica
    await replicas.refresh()
    hot_fake.events.put(pb.KVEventBatch(snapshot=True, stored=held))
    fakes[1].replica.events.put(pb.KVEventBatch(snapshot=True, stored=held[:5]))  # the system prompt
    await index_becomes(hot, set(held))
    router = await serve_router(RouterService(replicas))
    try:
        first = asyncio.create_task(router.generate(request(prompts[0], request_id="first")))
        await until(lambda: len(hot_fake.generate_calls) == 1, "the first follow-up reaching its replica")
        second = asyncio.create_task(router.generate(request(prompts[1], request_id="second")))
        await until(lambda: sum(len(f.replica.generate_calls) for f in fakes) == 2, "the second follow-up")
        for fake in fakes:
            assert fake.replica.script.hold is not None
            fake.replica.script.hold.set()
        assert await first == await second == [5, 6, 7]
    finally:
        await router.close()
    assert [r.request_id for r in hot_fake.generate_calls] == ["first", "second"]
