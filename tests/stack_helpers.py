"""Starting real service processes on loopback for integration tests, and waiting for their health."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.ports import free_port as free_port  # re-exported: the integration tests take ports here

REPO_ROOT = Path(__file__).resolve().parent.parent
KVRELAY = [sys.executable, "-m", "services.cli.main"]


class Proc:
    """A child process whose output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(
        self, args: list[str], env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            (command or KVRELAY) + args,
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def stack_env(token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update({"KVRELAY_INTERNAL_TOKEN": token, "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def start_worker_proc(model: Path, logs: Path, name: str, env: dict[str, str]) -> tuple[Proc, str]:
    """`kvrelay worker` on one thread at a free loopback port, logging to `<logs>/<name>.log` (not waited
    on: `wait_serving` it); the process and its address."""
    address = f"127.0.0.1:{free_port()}"
    args = [
        "worker",
        "--model",
        str(model),
        "--port",
        address.split(":")[1],
        "--threads",
        "1",
        "--name",
        name,
    ]
    return Proc(args, env, logs / f"{name}.log"), address


def wait_serving(address: str, proc: Proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout}s:\n{proc.log()[-3000:]}")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls `condition()` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Polls `condition()` until it gives a true value, and gives it; AssertionError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return value


def wait_idle(
    stub: worker_pb2_grpc.WorkerStub, metadata: tuple[tuple[str, str], ...], timeout_s: float = 60.0
) -> pb.LoadResponse:
    """The worker's Load once nothing runs, waits or holds a KV block; AssertionError if that never comes."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = stub.Load(pb.LoadRequest(), metadata=metadata, timeout=10)
        if load.running == load.waiting == load.kv_blocks.active == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"the worker still holds work {timeout_s} s on: {load}")
        time.sleep(0.05)


def assert_cut_short(before: pb.LoadResponse, after: pb.LoadResponse, max_tokens: int) -> int:
    """Exactly one request was aborted on the worker between the two Loads, long before max_tokens."""
    num_aborted = after.requests_aborted_total - before.requests_aborted_total
    assert num_aborted == 1, f"the worker aborted {num_aborted} requests, not the one cut short"
    generated = after.generation_tokens_total - before.generation_tokens_total
    assert 0 < generated < max_tokens // 4, f"the worker generated {generated} of {max_tokens} tokens"
    assert after.kv_blocks.active == 0 and after.running == 0
    return generated


def run_python(code: str, stdin: bytes = b"") -> bytes:
    """`python -c code` in a child process of its own (the repo importable), its stdout; fails the test on
    a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout


def replace_file(path: Path, text: str) -> None:
    """Replace a file as a mounted Secret changes: a new file renamed over it, with a later mtime (so a
    reader that watches the mtime sees the change even within one clock tick)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    mtime = path.stat().st_mtime_ns + 1_000_000_000 if path.exists() else None
    os.replace(temporary, path)
    if mtime is not None:
        os.utime(path, ns=(mtime, mtime))
