"""The router's retry, on a real router process over a fake replica (at the gRPC seam) and a real worker
(tiny random-weight model), round-robin so the fake is tried first: a replica that fails with UNAVAILABLE
before any token is ejected and the request is served by the other, with the tokens the worker gives;
once a token has gone out the error reaches the client and no other replica is tried (a retry would
repeat tokens). A replica whose waiting queue is full (RESOURCE_EXHAUSTED) is passed over, not ejected. A
replica cut off by a network partition (a proxy that drops every byte both ways and closes nothing) is found
by the channel's keepalive, ejected, and the request served by the other."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import BUSY_KEY
from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.fault_proxy import BLACKHOLE, FaultProxy
from tests.router_fakes import FakeReplica, FakeServer, GenerateScript, start_fake
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "retry-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [5, 9, 17, 33, 2, 8]


@dataclass
class Worker:
    stub: worker_pb2_grpc.WorkerStub
    address: str
    fingerprint: str


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        ["worker", "--model", str(model), "--port", address.split(":")[1], "--threads", "1"],
        env,
        tmp_path_factory.mktemp("retry-logs") / "worker.log",
    )
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as channel:
            yield Worker(
                worker_pb2_grpc.WorkerStub(channel), address, load_verified_manifest(model).model_fingerprint
            )
    finally:
        proc.stop()


@dataclass
class Router:
    proc: Proc
    stub: worker_pb2_grpc.WorkerStub
    metrics_port: int
    address: str

    def retries(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return next(s.value for s in samples if s.name == "kvrelay_router_retries_total")


@pytest.fixture
def fake(worker: Worker) -> Iterator[FakeServer]:
    server = start_fake(FakeReplica(worker.fingerprint))
    yield server
    server.stop()


@pytest.fixture
def router(worker: Worker, fake: FakeServer, tmp_path: Path) -> Iterator[Router]:
    """Round-robin over [fake, worker]: the first request tries the fake first."""
    yield from start_router(fake.address, worker, tmp_path)


@pytest.fixture
def proxy(fake: FakeServer) -> Iterator[FaultProxy]:
    made = FaultProxy(int(fake.address.rsplit(":", 1)[1]))
    yield made
    made.close()


@pytest.fixture
def partitionable_router(worker: Worker, proxy: FaultProxy, tmp_path: Path) -> Iterator[Router]:
    """Round-robin over [the fake behind a fault proxy, worker]."""
    yield from start_router(f"127.0.0.1:{proxy.port}", worker, tmp_path)


def start_router(first: str, worker: Worker, tmp_path: Path) -> Iterator[Router]:
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    proc = Proc(
        [
            *("router", "--port", address.split(":")[1], "--workers", f"{first},{worker.address}"),
            *("--metrics-port", str(metrics_port)),
        ],
        stack_env(TOKEN, KVRELAY_ROUTER__POLICY="round_robin"),
        tmp_path / "router.log",
    )
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            wait_for(lambda: all_ready(channel, 2), "both replicas ready in the router")
            yield Router(proc, stub, metrics_port, address)
    finally:
        proc.stop()


def all_ready(channel: grpc.Channel, num_replicas: int) -> bool:
    listed = worker_pb2_grpc.RouterStub(channel).Replicas(pb.ReplicasRequest(), metadata=MD).replicas
    return len(listed) == num_replicas and all(r.ready for r in listed)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def request(request_id: str) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )


def tokens(responses: Iterator[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_replica_failing_before_the_first_token_is_retried_on_another(
    worker: Worker, fake: FakeServer, router: Router, status: grpc.StatusCode
) -> None:
    """CANCELLED too: a replica whose server is stopping cancels a call that reached it as the drain began
    (seen in the suite's drain test), and the client never asked for that."""
    expected = tokens(worker.stub.Generate(request("direct"), metadata=MD, timeout=30))
    served_before = worker.stub.Load(pb.LoadRequest(), metadata=MD).requests_total
    fake.replica.script = GenerateScript(fail_after=0, fail_with=status)

    got = tokens(router.stub.Generate(request("retried"), metadata=MD, timeout=30))

    assert got == expected and len(got) == 6
    assert [c.request_id for c in fake.replica.generate_calls] == ["retried"]  # tried first, and failed
    assert worker.stub.Load(pb.LoadRequest(), metadata=MD).requests_total == served_before + 1
    assert router.retries() == 1
    log = router.proc.log()
    assert "retrying on another replica" in log
    ejected = [line for line in log.splitlines() if "replica ejected" in line]
    assert ejected and fake.address in ejected[0] and status.name in ejected[0]


def test_a_replica_with_a_full_queue_is_passed_over_and_not_ejected(
    worker: Worker, fake: FakeServer, router: Router
) -> None:
    expected = tokens(worker.stub.Generate(request("direct-busy"), metadata=MD, timeout=30))
    fake.replica.script = GenerateScript(
        fail_after=0, fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED, fail_metadata=((BUSY_KEY, "1"),)
    )

    got = tokens(router.stub.Generate(request("busy"), metadata=MD, timeout=30))

    assert got == expected
    assert [c.request_id for c in fake.replica.generate_calls] == ["busy"]  # tried first: it was full
    assert router.retries() == 1
    assert "replica ejected" not in router.proc.log()  # busy is not broken
    with grpc.insecure_channel(router.address) as channel:
        assert all_ready(channel, 2)


def test_a_partitioned_replica_is_found_by_keepalive_and_the_request_served_by_another(
    worker: Worker, fake: FakeServer, proxy: FaultProxy, partitionable_router: Router
) -> None:
    router = partitionable_router
    expected = tokens(worker.stub.Generate(request("direct-cut"), metadata=MD, timeout=30))
    proxy.mode = BLACKHOLE  # the replica's link goes silent: no FIN, no RST, nothing answers

    got = tokens(router.stub.Generate(request("cut-off"), metadata=MD, timeout=90))

    assert got == expected  # served by the other replica, before any token went out
    assert router.retries() >= 1
    ejected = [line for line in router.proc.log().splitlines() if "replica ejected" in line]
    assert ejected and str(proxy.port) in ejected[0]


def test_grpcs_own_resource_exhausted_is_no_busy_mark_and_reaches_the_client(
    worker: Worker, fake: FakeServer, router: Router
) -> None:
    """RESOURCE_EXHAUSTED without the busy mark (gRPC's own: a message over its size limit) is the
    request's fault: not retried elsewhere."""
    fake.replica.script = GenerateScript(fail_after=0, fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(grpc.RpcError) as refused:
        tokens(router.stub.Generate(request("too-big"), metadata=MD, timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert router.retries() == 0


def test_once_a_token_went_out_the_error_reaches_the_client_and_nothing_is_retried(
    worker: Worker, fake: FakeServer, router: Router
) -> None:
    served_before = worker.stub.Load(pb.LoadRequest(), metadata=MD).requests_total
    fake.replica.script = GenerateScript(token_ids=[9, 10, 11], fail_after=1)

    received: list[int] = []
    with pytest.raises(grpc.RpcError) as failed:
        for response in router.stub.Generate(request("mid-stream"), metadata=MD, timeout=30):
            received.extend(response.token_ids)

    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert received == [9]  # the fake's one token, and nothing from another replica after it
    assert [c.request_id for c in fake.replica.generate_calls] == ["mid-stream"]
    assert worker.stub.Load(pb.LoadRequest(), metadata=MD).requests_total == served_before
    assert router.retries() == 0
