"""The internal token rotated through its file under live traffic: a real router and worker (tiny
random-weight model) and a client that all read one token file, taken through the three rotation steps
(grpc_auth.py) while requests keep flowing. No request fails, and afterwards the old token is refused by
both services."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common.grpc_auth import TokenSource
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, replace_file, stack_env, wait_serving, wait_until
from tests.tiny_model import make_tiny_llama

OLD = "old-token-0123456789abcdef"
NEW = "new-token-0123456789abcdef"
PROMPT = [(i * 3) % 100 + 2 for i in range(12)]
REQUESTS_PER_STEP = 5


@dataclass
class Traffic:
    """Requests sent one after another through the router with the file's current token."""

    router: worker_pb2_grpc.WorkerStub
    tokens: TokenSource
    num_ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        while not self.stop.is_set():
            request = pb.GenerateRequest(request_id=f"r{self.num_ok}", prompt_token_ids=PROMPT)
            request.sampling.CopyFrom(sampling_to_proto(params))
            try:
                stream = self.router.Generate(request, metadata=self.tokens.metadata(), timeout=60)
                assert sum(len(r.token_ids) for r in stream) == 2
                self.num_ok += 1
            except (grpc.RpcError, AssertionError) as exc:
                self.failures.append(repr(exc))
                return


@dataclass
class Stack:
    token_file: Path
    router: str
    worker: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rotation")
    token_file = tmp / "token"
    replace_file(token_file, f"{OLD}\n")
    env = stack_env(
        "unused-0123456789abcdef", KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8"
    )
    del env["KVRELAY_INTERNAL_TOKEN"]
    env["KVRELAY_INTERNAL_TOKEN_FILE"] = str(token_file)
    model = make_tiny_llama(tmp / "tiny")
    worker, router = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [Proc(["worker", "--model", str(model), "--port", worker.split(":")[1], "--threads", "1"], env,
                  tmp / "worker.log")]  # fmt: skip
    try:
        wait_serving(worker, procs[0])
        procs.append(
            Proc(["router", "--port", router.split(":")[1], "--workers", worker], env, tmp / "router.log")
        )
        wait_serving(router, procs[1])
        yield Stack(token_file, router, worker)
    finally:
        for proc in procs:
            proc.stop()


def test_rotating_the_token_file_under_traffic_fails_no_request(stack: Stack) -> None:
    with grpc.insecure_channel(stack.router) as channel:
        traffic = Traffic(worker_pb2_grpc.WorkerStub(channel), TokenSource(path=stack.token_file))
        wait_until(lambda: _ready(traffic), timeout_s=120, what="the router never served a first request")
        thread = threading.Thread(target=traffic.run, daemon=True)
        thread.start()
        try:
            for lines in ([OLD, NEW], [NEW, OLD], [NEW]):
                done = traffic.num_ok
                replace_file(stack.token_file, "\n".join(lines) + "\n")
                wait_until(
                    lambda done=done: traffic.num_ok >= done + REQUESTS_PER_STEP or bool(traffic.failures),
                    timeout_s=120,
                    what=f"no traffic after writing {len(lines)} token(s)",
                )
        finally:
            traffic.stop.set()
            thread.join(60)
        assert not traffic.failures, traffic.failures
        assert traffic.num_ok >= 3 * REQUESTS_PER_STEP
    for address in (stack.router, stack.worker):
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Info(pb.InfoRequest(), metadata=(("authorization", f"Bearer {OLD}"),), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Info(pb.InfoRequest(), metadata=(("authorization", f"Bearer {NEW}"),), timeout=10)


def _ready(traffic: Traffic) -> bool:
    """One request through, sent on this thread (the router has found its worker)."""
    request = pb.GenerateRequest(request_id="warm", prompt_token_ids=PROMPT)
    request.sampling.CopyFrom(sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=1)))
    try:
        list(traffic.router.Generate(request, metadata=traffic.tokens.metadata(), timeout=30))
    except grpc.RpcError:
        return False
    return True
