"""A real stack (worker, router, codec as separate processes) on the real model, shared by the e2e tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving

TOKEN = "e2e-internal-token"


@dataclass
class RunningStack:
    base_url: str
    worker_address: str
    router_address: str
    procs: list[Proc]

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.procs)


def worker_load(stack: RunningStack) -> pb.LoadResponse:
    """The worker's live load: running and waiting requests, KV blocks."""
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return stub.Load(pb.LoadRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))


def wait_http_ready(url: str, proc: Proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"codec exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready:\n{proc.log()[-3000:]}")


def start_stack(model_dir: Path, logs: Path, **env: str) -> RunningStack:
    base_env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", **env)
    worker = f"127.0.0.1:{free_port()}"
    router = f"127.0.0.1:{free_port()}"
    codec_port = free_port()
    w = Proc(
        ["worker", "--model", str(model_dir), "--port", worker.split(":")[1]], base_env, logs / "worker.log"
    )
    r = Proc(["router", "--port", router.split(":")[1], "--workers", worker], base_env, logs / "router.log")
    c = Proc(
        ["codec", "--model", str(model_dir), "--router", router, "--port", str(codec_port)],
        base_env,
        logs / "codec.log",
    )
    procs = [w, r, c]
    try:
        wait_serving(worker, w)
        wait_serving(router, r)
        url = f"http://127.0.0.1:{codec_port}"
        wait_http_ready(url, c)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return RunningStack(url, worker, router, procs)


@pytest.fixture(scope="session")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(model_dir, tmp_path_factory.mktemp("stack-logs"))
    yield running
    for proc in reversed(running.procs):
        proc.stop()
