"""Real worker and router processes over gRPC on loopback, on tiny random-weight models."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.engine_helpers import generate, make_engine
from tests.stack_helpers import Proc, assert_cut_short, free_port, stack_env, wait_idle, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "test-internal-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
# The served model's context: a request as long as it runs for seconds (about 5 s for 16k tokens on one
# thread), so a cancel or a deadline that lands within milliseconds must cut it far short.
CONTEXT = 16384
LONG_CONTEXT = {"max_position_embeddings": CONTEXT}


class Stack:
    def __init__(self, tmp: Path, model_dirs: list[Path]) -> None:
        env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="16")
        self.worker_addrs = [f"127.0.0.1:{free_port()}" for _ in model_dirs]
        self.router_addr = f"127.0.0.1:{free_port()}"
        self.workers = [
            Proc(
                [
                    "worker",
                    "--model",
                    str(d),
                    "--port",
                    addr.split(":")[1],
                    "--threads",
                    "1",
                    "--name",
                    f"w{i}",
                ],
                env,
                tmp / f"worker{i}.log",
            )
            for i, (d, addr) in enumerate(zip(model_dirs, self.worker_addrs, strict=True))
        ]
        workers_arg = ",".join(self.worker_addrs)
        pool = load_verified_manifest(model_dirs[0]).model_fingerprint  # the first model is the pool's
        self.router = Proc(
            [
                "router",
                "--port",
                self.router_addr.split(":")[1],
                "--workers",
                workers_arg,
                "--model-fingerprint",
                pool,
            ],
            env,
            tmp / "router.log",
        )
        for proc, addr in zip(self.workers, self.worker_addrs, strict=True):
            wait_serving(addr, proc)
        wait_serving(self.router_addr, self.router)
        self.channel = grpc.insecure_channel(self.router_addr)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def worker_stub(self, i: int) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(self.worker_addrs[i]))

    def stop(self) -> None:
        self.channel.close()
        for proc in [self.router, *self.workers]:
            proc.stop()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("models")
    return [make_tiny_llama(root / "a", seed=0, **LONG_CONTEXT), make_tiny_llama(root / "b", seed=1)]


@pytest.fixture(scope="module")
def stack(tiny_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), [tiny_dirs[0], tiny_dirs[1]])  # b serves another model
    yield s
    s.stop()


def request(rid: str, prompt: list[int], **sampling: object) -> pb.GenerateRequest:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))


def test_internal_calls_need_the_token_and_health_does_not(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Info(pb.InfoRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Info(pb.InfoRequest(), metadata=(("authorization", "Bearer wrong"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(stack.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_router_streams_the_engines_greedy_tokens(stack: Stack, tiny_dirs: list[Path]) -> None:
    prompt = [3, 9, 27, 81 % 128, 5]
    got = [
        t for r in stack.stub.Generate(request("g1", prompt, max_tokens=10), metadata=MD) for t in r.token_ids
    ]
    want = generate(
        make_engine(tiny_dirs[0]),
        {"x": prompt},
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    )
    assert got == want["x"]


def test_router_never_uses_a_worker_with_another_model_fingerprint(stack: Stack) -> None:
    deadline = time.monotonic() + 30  # the router names the stray worker once it has probed it
    while "replica serves another model" not in stack.router.log():
        if time.monotonic() > deadline:
            pytest.fail("the router did not report the worker with another fingerprint within 30 s")
        time.sleep(0.1)
    replicas = worker_pb2_grpc.RouterStub(stack.channel).Replicas(pb.ReplicasRequest(), metadata=MD).replicas
    assert [r.ready for r in replicas] == [True, False]
    for i in range(6):
        list(stack.stub.Generate(request(f"fp{i}", [4, 5, 6]), metadata=MD))
    assert stack.worker_stub(1).Load(pb.LoadRequest(), metadata=MD).requests_total == 0
    assert "replica serves another model" in stack.router.log()
    assert stack.worker_addrs[1] in stack.router.log()


def test_cancelled_stream_stops_the_request_and_frees_every_block(stack: Stack) -> None:
    worker = stack.worker_stub(0)
    before = wait_idle(worker, MD)
    prompt = list(range(2, 10))
    max_tokens = CONTEXT - len(prompt)
    call = stack.stub.Generate(request("c1", prompt, max_tokens=max_tokens), metadata=MD)
    assert next(call).token_ids  # the request is generating on the worker
    call.cancel()
    assert_cut_short(before, wait_idle(worker, MD), max_tokens)


def test_deadline_expiry_stops_the_request_and_frees_blocks(stack: Stack) -> None:
    worker = stack.worker_stub(0)
    before = wait_idle(worker, MD)
    prompt = list(range(2, 10))
    max_tokens = CONTEXT - len(prompt)
    received = 0
    with pytest.raises(grpc.RpcError) as err:
        call = stack.stub.Generate(request("d1", prompt, max_tokens=max_tokens), metadata=MD, timeout=0.2)
        for response in call:
            received += len(response.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    generated = assert_cut_short(before, wait_idle(worker, MD), max_tokens)
    assert received <= generated


def test_invalid_tokens_are_invalid_argument(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(request("bad", [5, 999]), metadata=MD))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "999" in (err.value.details() or "")
