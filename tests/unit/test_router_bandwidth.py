"""The router's KV transfer bandwidth estimate, through a real in-process router over fake replicas (one
prefill, one busy decode): it starts at `router.transfer_bytes_per_s`, moves as a moving average toward
each remote prefill's measured link rate (bytes over the shipping seconds, P's prefill left out, on the
stream's last message), ignores local
prefills, and feeds the conditional disaggregation decision: slow transfers turn remote into local."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from services.common.config import DisaggregationConfig, RouterConfig
from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.router.replicas import ReplicaSet
from services.router.router_service import BANDWIDTH_EWMA, RouterService
from tests.router_fakes import FakeReplica, FakeServer, GenerateScript, serve_router, start_fake

FINGERPRINT = "fp-bandwidth"
NUM_PROMPT_TOKENS = 1000
KV_BYTES_PER_TOKEN = 10_000  # the prompt's KV: 1e7 bytes
# At 1000 prompt tokens/s, the decode replica's local prefill takes 1 s and stalls its 4 running streams:
# local cost 1 + 4 x 1 x 0.25 = 2 s. Remote: the idle prefill replica's 1 s plus 1e7 bytes over the
# estimate, so remote is cheaper while the estimate is above 1e7 bytes/s.
ROUTING = RouterConfig(prefill_tokens_per_s=1000.0, per_running_seq_ms=2.0, transfer_bytes_per_s=2e7)
SLOW_TRANSFER = pb.GenerateResponse(
    prefill_mode=pb.PREFILL_MODE_REMOTE,
    kv_transfer_bytes=10_000_000,
    kv_transfer_seconds=101.0,  # P's 1 s prefill, then the shipping
    kv_link_seconds=100.0,
)  # 1e5 bytes/s
# A fast link behind a slow prefill: 9.9 s of P's queue and prefill, then 0.1 s on the wire (1e8 bytes/s).
BUSY_PREFILL_FAST_LINK = pb.GenerateResponse(
    prefill_mode=pb.PREFILL_MODE_REMOTE,
    kv_transfer_bytes=10_000_000,
    kv_transfer_seconds=10.0,
    kv_link_seconds=0.1,
)


@pytest.fixture
def fakes() -> Iterator[tuple[FakeServer, FakeServer]]:
    prefill = start_fake(FakeReplica(FINGERPRINT, role="prefill"))
    decode = start_fake(FakeReplica(FINGERPRINT, role="decode"))
    decode.replica.info.kv_bytes_per_token = KV_BYTES_PER_TOKEN
    decode.replica.load = pb.LoadResponse(ready=True, running=4)
    decode.replica.script = GenerateScript(remote_last=SLOW_TRANSFER)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture
async def replicas(fakes: tuple[FakeServer, FakeServer]) -> AsyncIterator[ReplicaSet]:
    replica_set = ReplicaSet([f.address for f in fakes], TokenSource("t"), watch_kv_events=False)
    await replica_set.refresh()
    assert {r.role for r in replica_set.usable()} == {"prefill", "decode"}
    yield replica_set
    await replica_set.close()


def request(i: int) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=3)
    prompt = [2 + (i + j) % 100 for j in range(NUM_PROMPT_TOKENS)]
    return pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=sampling_to_proto(params))


async def test_slow_transfers_lower_the_estimate_until_prefills_stay_local(
    fakes: tuple[FakeServer, FakeServer], replicas: ReplicaSet
) -> None:
    prefill, decode = fakes
    service = RouterService(replicas, DisaggregationConfig(policy="conditional"), ROUTING)
    assert service.transfer_bytes_per_s == 2e7
    expected = 2e7
    router = await serve_router(service)
    try:
        for i in range(5):
            assert await router.generate(request(i)) == [5, 6, 7]
            if decode.replica.generate_calls[-1].remote_prefill.address:
                expected += BANDWIDTH_EWMA * (1e5 - expected)
            assert service.transfer_bytes_per_s == pytest.approx(expected), i
    finally:
        await router.close()
    # The estimate after each transfer: 1.6e7, 1.28e7, 1.03e7 still ship the prompt; 8.3e6 does not.
    shipped_to = [c.remote_prefill.address for c in decode.replica.generate_calls]
    assert shipped_to == [prefill.address] * 4 + [""]
    assert service.decisions == {("remote", "remote_cheaper"): 4, ("local", "local_cheaper"): 1}
    assert service.transfer_bytes_per_s == pytest.approx(1e5 + (2e7 - 1e5) * 0.8**4)


async def test_the_estimate_starts_at_the_configured_rate(
    fakes: tuple[FakeServer, FakeServer], replicas: ReplicaSet
) -> None:
    prefill, decode = fakes
    slow_link = ROUTING.model_copy(update={"transfer_bytes_per_s": 5e6})  # 2 s for the prompt's KV
    fast_link = ROUTING.model_copy(update={"transfer_bytes_per_s": 1e8})
    for config, shipped in ((slow_link, ""), (fast_link, prefill.address)):
        service = RouterService(replicas, DisaggregationConfig(policy="conditional"), config)
        router = await serve_router(service)
        try:
            await router.generate(request(0))
        finally:
            await router.close()
        assert decode.replica.generate_calls[-1].remote_prefill.address == shipped


async def test_the_estimate_learns_the_link_not_the_prefill_replicas_queue(
    fakes: tuple[FakeServer, FakeServer], replicas: ReplicaSet
) -> None:
    """P's prefill is counted by the remote estimate already; in the bandwidth it would count twice."""
    _, decode = fakes
    decode.replica.script = GenerateScript(remote_last=BUSY_PREFILL_FAST_LINK)
    service = RouterService(replicas, DisaggregationConfig(policy="conditional"), ROUTING)
    router = await serve_router(service)
    try:
        await router.generate(request(0))
    finally:
        await router.close()
    assert decode.replica.generate_calls[-1].remote_prefill.address  # shipped at the configured 2e7
    assert service.transfer_bytes_per_s == pytest.approx(2e7 + BANDWIDTH_EWMA * (1e8 - 2e7))
