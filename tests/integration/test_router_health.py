"""The router under failing replicas: a fake replica that starts healthy and then hangs, answers garbage,
or changes model is ejected with a log line that names it; a real worker killed under load ends its own
streams with a clean error while the survivor serves everything else."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.router_fakes import serve_worker
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "health-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
NUM_STREAMS = 6
# Long enough (a second or more on a shared 2-core machine) that no stream ends between seeing where the
# streams are and the kill; the survivor still finishes its share quickly.
STREAM_TOKENS = 6000


@dataclass
class Mode:
    name: str = "healthy"


class FakeReplica(worker_pb2_grpc.WorkerServicer):
    """Answers Info and Load like a worker of `fingerprint` until `mode` says otherwise."""

    def __init__(self, fingerprint: str, mode: Mode) -> None:
        self.fingerprint = fingerprint
        self.mode = mode

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(model_fingerprint=self.fingerprint, role="colocated", block_size=16)

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        if self.mode.name == "hang":
            time.sleep(4.0)
        if self.mode.name == "garbage":
            context.abort(grpc.StatusCode.INTERNAL, "\x00garbage\x00")
        return pb.LoadResponse(ready=True)


def start_fake(fingerprint: str, mode: Mode) -> tuple[grpc.Server, str]:
    return serve_worker(FakeReplica(fingerprint, mode))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=6144)


def start_worker(tiny: Path, logs: Path, name: str) -> tuple[Proc, str]:
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="16")
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        ["worker", "--model", str(tiny), "--port", address.split(":")[1], "--threads", "1", "--name", name],
        env,
        logs / f"{name}.log",
    )
    return proc, address


def start_router(addresses: list[str], logs: Path) -> tuple[Proc, str]:
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        ["router", "--port", address.split(":")[1], "--workers", ",".join(addresses)],
        stack_env(TOKEN),
        logs / "router.log",
    )
    return proc, address


def replicas(router_address: str) -> dict[str, bool]:
    with grpc.insecure_channel(router_address) as channel:
        listed = worker_pb2_grpc.RouterStub(channel).Replicas(pb.ReplicasRequest(), metadata=MD).replicas
    return {r.address: r.ready for r in listed}


def wait_for(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met")


@pytest.mark.parametrize("fault", ["hang", "garbage"])
def test_a_replica_that_turns_bad_is_ejected_and_named(tiny: Path, tmp_path: Path, fault: str) -> None:
    fingerprint = load_verified_manifest(tiny).model_fingerprint
    mode = Mode()
    fake, fake_address = start_fake(fingerprint, mode)
    router, router_address = start_router([fake_address], tmp_path)
    try:
        wait_serving(router_address, router)
        wait_for(lambda: replicas(router_address).get(fake_address) is True)
        mode.name = fault
        wait_for(lambda: "replica ejected" in router.log())
        ejected = [line for line in router.log().splitlines() if "replica ejected" in line]
        assert fake_address in ejected[0]
        assert replicas(router_address)[fake_address] is False
        mode.name = "healthy"
        wait_for(lambda: replicas(router_address).get(fake_address) is True, timeout=30)
    finally:
        router.stop()
        fake.stop(0)


def stream_placement(
    received: list[int], workers: list[worker_pb2_grpc.WorkerStub], timeout: float = 60.0
) -> list[int]:
    """Once every stream has had a token, the streams each worker holds (its Load's running + waiting),
    when they account for all of them: nothing was retried elsewhere and nothing has finished yet."""
    deadline = time.monotonic() + timeout
    held: list[int] = []
    while time.monotonic() < deadline:
        if all(received):
            loads = [worker.Load(pb.LoadRequest(), metadata=MD) for worker in workers]
            held = [load.running + load.waiting for load in loads]
            if sum(held) == len(received):
                return held
        time.sleep(0.005)
    pytest.fail(f"the streams were never all under way within {timeout} s: tokens {received}, held {held}")


def test_killed_worker_ends_its_streams_cleanly_and_the_survivor_serves(tiny: Path, tmp_path: Path) -> None:
    (w0, a0), (w1, a1) = start_worker(tiny, tmp_path, "w0"), start_worker(tiny, tmp_path, "w1")
    router, router_address = start_router([a0, a1], tmp_path)
    procs = [router, w0, w1]
    try:
        for proc, address in ((w0, a0), (w1, a1), (router, router_address)):
            wait_serving(address, proc)
        wait_for(lambda: all(replicas(router_address).values()) and len(replicas(router_address)) == 2)
        channel = grpc.insecure_channel(router_address)
        stub = worker_pb2_grpc.WorkerStub(channel)
        outcomes: dict[int, str] = {}
        received = [0] * NUM_STREAMS

        def stream(i: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
            request = pb.GenerateRequest(
                request_id=f"long-{i}", prompt_token_ids=[3 + i, 4, 5], sampling=sampling_to_proto(params)
            )
            try:
                for response in stub.Generate(request, metadata=MD, timeout=120):
                    received[i] += len(response.token_ids)
                outcomes[i] = "ok" if received[i] == STREAM_TOKENS else f"short {received[i]}"
            except grpc.RpcError as exc:
                outcomes[i] = exc.code().name

        worker_channels = [grpc.insecure_channel(address) for address in (a0, a1)]
        workers = [worker_pb2_grpc.WorkerStub(c) for c in worker_channels]
        assert all(worker.Load(pb.LoadRequest(), metadata=MD).ready for worker in workers)  # connected
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        on_victim, on_survivor = stream_placement(received, workers)
        assert on_victim >= 1 and on_survivor >= 1, f"the router put every stream on one worker: {outcomes}"
        w0.popen.kill()  # streams known to be on it, each past its first token
        for thread in threads:
            thread.join(180)
        assert sorted(outcomes.values()) == ["UNAVAILABLE"] * on_victim + ["ok"] * on_survivor, outcomes
        served_before = workers[1].Load(pb.LoadRequest(), metadata=MD).requests_total
        for i in range(6):  # new requests: all served (by the survivor), none fails
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            request = pb.GenerateRequest(
                request_id=f"after-{i}", prompt_token_ids=[7, 8, 9 + i], sampling=sampling_to_proto(params)
            )
            assert sum(len(r.token_ids) for r in stub.Generate(request, metadata=MD, timeout=60)) == 8
        assert workers[1].Load(pb.LoadRequest(), metadata=MD).requests_total == served_before + 6
        for c in [channel, *worker_channels]:
            c.close()
    finally:
        for proc in procs:
            proc.stop()
