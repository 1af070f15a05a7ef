"""The router's KV transport per (prefill, decode) pair: ipc only inside one ipc_domain, and with ipc the
prefill replica on the decode replica's GPU is picked first (real router, fake replicas)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.config import DisaggregationConfig, RouterConfig
from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.replicas import ReplicaSet, pair_transport
from services.router.router_service import RouterService
from tests.router_fakes import FakeReplica, FakeServer, serve_router, start_fake

FINGERPRINT = "fp-transport"


def info(domain: str) -> pb.InfoResponse:
    return pb.InfoResponse(ipc_domain=domain)


def test_ipc_is_kept_for_a_pair_in_one_domain() -> None:
    assert pair_transport("ipc", info("gpu-a"), info("gpu-a")) == "ipc"


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [(info("gpu-a"), info("gpu-b")), (info(""), info("")), (None, info("gpu-a")), (info("gpu-a"), None)],
)
def test_ipc_becomes_grpc_for_any_other_pair(
    prefill: pb.InfoResponse | None, decode: pb.InfoResponse | None
) -> None:
    assert pair_transport("ipc", prefill, decode) == "grpc"


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_other_transports_pass_through(transport: str) -> None:
    assert pair_transport(transport, info("gpu-a"), info("gpu-b")) == transport


@pytest.fixture
def pool() -> Iterator[dict[str, FakeServer]]:
    """A decode replica on GPU b, an idle prefill replica on GPU a and a busy one sharing GPU b."""
    fakes = {
        "prefill-a": start_fake(FakeReplica(FINGERPRINT, role="prefill")),
        "prefill-b": start_fake(FakeReplica(FINGERPRINT, role="prefill")),
        "decode-b": start_fake(FakeReplica(FINGERPRINT, role="decode")),
    }
    for name, fake in fakes.items():
        fake.replica.info.ipc_domain = f"gpu-{name[-1]}"
    fakes["prefill-b"].replica.load = pb.LoadResponse(ready=True, running=6, waiting=6)
    yield fakes
    for fake in fakes.values():
        fake.stop()


async def route_once(pool: dict[str, FakeServer], transport: str) -> pb.RemotePrefill:
    replica_set = ReplicaSet([f.address for f in pool.values()], TokenSource("t"), watch_kv_events=False)
    await replica_set.refresh()
    service = RouterService(
        replica_set, DisaggregationConfig(policy="always", transport=transport), RouterConfig()
    )
    router = await serve_router(service)
    try:
        params = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=3))
        await router.generate(
            pb.GenerateRequest(request_id="r", prompt_token_ids=list(range(2, 200)), sampling=params)
        )
    finally:
        await router.close()
        await replica_set.close()
    return pool["decode-b"].replica.generate_calls[-1].remote_prefill


async def test_ipc_pairs_the_decode_replica_with_the_prefill_replica_on_its_gpu(
    pool: dict[str, FakeServer],
) -> None:
    remote = await route_once(pool, "ipc")
    assert remote.address == pool["prefill-b"].address and remote.transport == "ipc"


async def test_grpc_picks_the_idle_prefill_replica_wherever_it_is(pool: dict[str, FakeServer]) -> None:
    remote = await route_once(pool, "grpc")
    assert remote.address == pool["prefill-a"].address and remote.transport == "grpc"


async def test_ipc_without_a_prefill_replica_on_the_gpu_goes_over_grpc(pool: dict[str, FakeServer]) -> None:
    pool["prefill-b"].replica.info.ipc_domain = "gpu-c"
    remote = await route_once(pool, "ipc")
    assert remote.address == pool["prefill-a"].address and remote.transport == "grpc"
