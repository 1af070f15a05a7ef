"""Which replicas the router uses by model fingerprint (fake replicas at the gRPC seam): a pin names the
model directory (a manifest's model_fingerprint, as the chart sets it), while replicas report the weights
they serve, which differ from the directory's when model.weights serves its GGUF blocks. The pinned
directory's replicas are used whatever weights they serve, but a pool never mixes two forms of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.grpc_auth import TokenSource
from services.engine.loading.loader import weights_fingerprint
from services.router.replicas import ReplicaSet
from tests.router_fakes import FakeReplica, FakeServer, start_fake

DIRECTORY = "fp-directory"
INT8 = weights_fingerprint(DIRECTORY, "gguf-int8")
OTHER = "fp-another-directory"


def fake(served: str, directory: str) -> FakeServer:
    server = start_fake(FakeReplica(served))
    server.replica.info.directory_fingerprint = directory
    return server


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    started = [fake(INT8, DIRECTORY), fake(DIRECTORY, DIRECTORY), fake(OTHER, OTHER)]
    yield started
    for server in started:
        server.stop()


async def usable_after_probe(servers: list[FakeServer], pinned: str | None) -> tuple[ReplicaSet, list[bool]]:
    replica_set = ReplicaSet([s.address for s in servers], TokenSource("t"), pinned, watch_kv_events=False)
    await replica_set.refresh()
    usable = [replica.usable for replica in replica_set.replicas]
    await replica_set.close()
    return replica_set, usable


async def test_a_pinned_directory_takes_its_block_weights(servers: list[FakeServer]) -> None:
    replica_set, usable = await usable_after_probe(servers[:1] + servers[2:], DIRECTORY)
    assert usable == [True, False]  # the directory's blocks in, another directory out
    assert replica_set.model_fingerprint == INT8  # prefix hashes chain from the served weights


async def test_a_pool_never_mixes_two_forms_of_one_directory(servers: list[FakeServer]) -> None:
    """The first of the pinned directory's replicas to answer defines the served weights."""
    replica_set, usable = await usable_after_probe(servers, DIRECTORY)
    assert usable[:2] in ([True, False], [False, True]) and not usable[2]
    served = [INT8, DIRECTORY][usable.index(True)]
    assert replica_set.model_fingerprint == served


async def test_a_pin_of_the_served_fingerprint_still_works(servers: list[FakeServer]) -> None:
    _, usable = await usable_after_probe(servers[1:], DIRECTORY)
    assert usable == [True, False]


async def test_without_a_pin_one_model_defines_the_pool(servers: list[FakeServer]) -> None:
    replica_set, usable = await usable_after_probe([servers[0], servers[2]], None)
    assert sorted(usable) == [False, True]
    assert replica_set.model_fingerprint == [INT8, OTHER][usable.index(True)]


async def test_a_worker_without_the_field_counts_as_its_own_directory(servers: list[FakeServer]) -> None:
    servers[1].replica.info.ClearField("directory_fingerprint")
    _, usable = await usable_after_probe(servers[1:2], DIRECTORY)
    assert usable == [True]
