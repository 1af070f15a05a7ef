"""Real faults on real processes: two workers (a tiny random-weight model) and a router, round-robin, the
first worker (A) reached through a TCP proxy that can cut the link without a FIN or RST.

- A partition mid-stream: once A's first token has gone out, the proxy drops every byte both ways. The
  router's keepalive finds the silent link in seconds and the client's stream ends with UNAVAILABLE (no
  retry: a token went out), well before its deadline; A's own keepalive finds its client gone and aborts
  the request, so every KV block comes back; nothing reached B.
- A frozen worker (SIGSTOP): its kernel still accepts bytes, the process answers nothing. The request the
  router sends it is found stuck by keepalive, A is ejected and the request served whole by B, before
  any token. Once A is thawed (SIGCONT) it holds nothing and the router takes it back.

The decode replica killed mid-stream in disaggregated mode is in test_disaggregation_decode_death.py, a
worker killed under load in test_router_health.py, a replica partitioned before its first token in
test_router_retry.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.fault_proxy import BLACKHOLE, PASS, FaultProxy
from tests.stack_helpers import (
    Proc,
    free_port,
    stack_env,
    start_worker_proc,
    wait_for,
    wait_idle,
    wait_serving,
)
from tests.tiny_model import make_wide_tiny_llama

TOKEN = "faults-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = [5, 9, 17, 33, 2, 8]
LONG = 12_000  # tokens: far longer than keepalive needs to find a dead link (10 s + 5 s), on any CPU
KEEPALIVE_BOUND_S = 40.0  # waits on keepalive's 15 s, with room for a slow machine (calls: 120 s)


@dataclass
class Service:
    """A worker or the router: its process, address and a channel to it."""

    proc: Proc
    address: str
    channel: grpc.Channel

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    def load(self) -> pb.LoadResponse:
        return self.stub.Load(pb.LoadRequest(), metadata=MD, timeout=10)

    def ready(self) -> dict[str, bool]:
        """The router's replicas, by address: whether each takes requests now."""
        listed = worker_pb2_grpc.RouterStub(self.channel).Replicas(pb.ReplicasRequest(), metadata=MD).replicas
        return {r.address: r.ready for r in listed}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Deep enough that LONG tokens take far longer on one thread than keepalive needs.
    return make_wide_tiny_llama(
        tmp_path_factory.mktemp("tiny"), num_hidden_layers=8, max_position_embeddings=12_288
    )


def start_worker(model: Path, logs: Path, name: str) -> Service:
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="128")
    proc, address = start_worker_proc(model, logs, name, env)
    wait_serving(address, proc)
    return Service(proc, address, grpc.insecure_channel(address))


@pytest.fixture(scope="module")
def workers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    logs = tmp_path_factory.mktemp("faults-logs")
    a = start_worker(model, logs, "a")
    b = start_worker(model, logs, "b")
    yield a, b
    for worker in (a, b):
        worker.channel.close()
        if worker.proc.popen.poll() is None:
            os.kill(worker.proc.popen.pid, signal.SIGCONT)  # a test that failed with it frozen
        worker.proc.stop()


@pytest.fixture(scope="module")
def proxy(workers: tuple[Service, Service]) -> Iterator[FaultProxy]:
    running = FaultProxy(int(workers[0].address.split(":")[1]))
    yield running
    running.close()


@pytest.fixture
def router(workers: tuple[Service, Service], proxy: FaultProxy, tmp_path: Path) -> Iterator[Service]:
    """A fresh router per test, round-robin over [A through the proxy, B]: its first request goes to A."""
    proxy.mode = PASS
    address = f"127.0.0.1:{free_port()}"
    upstreams = f"127.0.0.1:{proxy.port},{workers[1].address}"
    proc = Proc(
        ["router", "--port", address.split(":")[1], "--workers", upstreams],
        stack_env(TOKEN, KVRELAY_ROUTER__POLICY="round_robin"),
        tmp_path / "router.log",
    )
    channel = grpc.insecure_channel(address)
    running = Service(proc, address, channel)
    try:
        wait_serving(address, proc)
        wait_for(lambda: len(running.ready()) == 2 and all(running.ready().values()), "both replicas ready")
        yield running
    finally:
        proxy.mode = PASS
        channel.close()
        proc.stop()


def request(rid: str, max_tokens: int) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params))


def test_a_partition_mid_stream_ends_the_stream_with_an_error_and_frees_the_worker(
    workers: tuple[Service, Service], proxy: FaultProxy, router: Service
) -> None:
    a, b = workers
    before_a, before_b = wait_idle(a.stub, MD), wait_idle(b.stub, MD)
    responses = iter(router.stub.Generate(request("partitioned", LONG), metadata=MD, timeout=120))
    assert next(responses).token_ids
    assert a.load().running == 1, "the stream is not decoding on A"

    proxy.mode = BLACKHOLE  # no FIN, no RST: the link just goes silent
    with pytest.raises(grpc.RpcError) as failed:
        for _ in responses:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the dead link was found by keepalive, not by the call's deadline

    after_a = wait_idle(a.stub, MD, timeout_s=KEEPALIVE_BOUND_S)  # A aborted the stream it could not send
    assert after_a.requests_aborted_total == before_a.requests_aborted_total + 1
    assert after_a.generation_tokens_total - before_a.generation_tokens_total < LONG
    assert b.load().requests_total == before_b.requests_total  # a token went out: never retried
    assert any(
        "replica ejected" in line and str(proxy.port) in line for line in router.proc.log().splitlines()
    )


def test_a_frozen_worker_is_ejected_and_its_request_served_whole_by_another(
    workers: tuple[Service, Service], proxy: FaultProxy, router: Service
) -> None:
    a, b = workers
    expected = [
        t for r in b.stub.Generate(request("direct", 8), metadata=MD, timeout=30) for t in r.token_ids
    ]
    before_b = wait_idle(b.stub, MD)
    os.kill(a.proc.popen.pid, signal.SIGSTOP)
    try:
        got = [
            t
            for r in router.stub.Generate(request("frozen", 8), metadata=MD, timeout=120)
            for t in r.token_ids
        ]
    finally:
        os.kill(a.proc.popen.pid, signal.SIGCONT)

    assert got == expected  # served by B, whole, no token from A
    assert b.load().requests_total == before_b.requests_total + 1
    assert any(
        "replica ejected" in line and str(proxy.port) in line for line in router.proc.log().splitlines()
    )
    wait_idle(a.stub, MD, timeout_s=KEEPALIVE_BOUND_S)  # thawed, A holds nothing for the call it never ran
    wait_for(
        lambda: router.ready().get(f"127.0.0.1:{proxy.port}"), "A back in the router", KEEPALIVE_BOUND_S * 2
    )
