"""The processes of `kvrelay bench transfer`: workers and routers on free loopback ports.

Every child is a `kvrelay worker` or `kvrelay router` in its own session (so a terminal's Ctrl-C reaches
only the bench, which then stops them), with one random internal token for the whole run and its output
in a log file. `Fleet.stop_all` (SIGTERM, then SIGKILL of the process group after a grace period) runs in
the bench's `finally`, with SIGINT and SIGTERM ignored meanwhile, so a second Ctrl-C cannot leave
children behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.cli.probes import GrpcHealthCheck
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 10.0
START_TIMEOUT_S = 300.0
GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    address: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of the run shares (sent as KVRELAY_* environment overrides)."""

    model: Path
    dtype: str
    kv_cache_mb: int


@dataclass
class Stack:
    """One serving setup: its routers by name (address), and its workers by role."""

    routers: dict[str, str]
    workers: dict[str, Child]
    children: list[Child] = field(default_factory=list)


class Fleet:
    """Every child process of one bench run, for one stop in the end."""

    def __init__(self, logs: Path, token: str, settings: WorkerSettings) -> None:
        self.logs = logs
        self.token = token
        self.settings = settings
        self.children: list[Child] = []
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        env.update(
            {
                "KVRELAY_INTERNAL_TOKEN": self.token,
                "PYTHONUNBUFFERED": "1",
                "KVRELAY_MODEL__DTYPE": self.settings.dtype,
                "KVRELAY_ENGINE__KV_CACHE_MEMORY_MB": str(self.settings.kv_cache_mb),
            }
        )
        env.update(extra)
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        port = free_port()
        log_path = self.logs / f"{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "services.cli.main", *args, "--port", str(port)],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        child = Child(name, f"127.0.0.1:{port}", popen, log_path)
        self.children.append(child)
        return child

    def worker(self, name: str, role: str, threads: int, env: dict[str, str]) -> Child:
        model = str(self.settings.model.resolve())
        args = ["worker", "--role", role, "--model", model, "--threads", str(threads), "--name", name]
        return self._spawn(name, [*args, "--grace-seconds", "5"], self._env(env))

    def router(self, name: str, workers: list[Child], env: dict[str, str]) -> Child:
        pool = ",".join(w.address for w in workers)
        return self._spawn(name, ["router", "--workers", pool, "--grace-seconds", "5"], self._env(env))

    def stop(self, children: list[Child]) -> None:
        """SIGTERM all at once, wait up to the grace period, then SIGKILL each one's process group."""
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for child in children:
                if child.popen.poll() is None:
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(max(0.0, deadline - time.monotonic()))
                if child.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.popen.pid, signal.SIGKILL)
                    child.popen.wait()
                if child in self.children:
                    self.children.remove(child)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_all(self) -> None:
        self.stop(list(self.children))


def wait_healthy(children: list[Child], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.popen.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n{child.log_tail()}")
            if GrpcHealthCheck(child.address).is_healthy():
                pending.remove(child)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[c.name for c in pending]} not serving after {timeout_s:.0f} s")
        time.sleep(0.2)


def wait_router_sees(fleet: Fleet, router: str, roles: list[str], timeout_s: float = 60.0) -> None:
    """Until the router's replica list has every one of `roles` ready."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(router, options=GRPC_OPTIONS) as channel:
        stub = worker_pb2_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            replicas = stub.Replicas(pb.ReplicasRequest(), metadata=fleet.metadata, timeout=5).replicas
            if sorted(r.role for r in replicas if r.ready) == sorted(roles):
                return
            time.sleep(0.2)
    raise TimeoutError(f"router {router} never saw ready {roles}")


def start_disaggregated(
    fleet: Fleet, tag: str, transport: str, threads: int, routers: dict[str, dict[str, str]]
) -> Stack:
    """One prefill and one decode worker (`threads` each), and one router per entry of `routers`
    (name: extra environment, such as KVRELAY_DISAGGREGATION__POLICY)."""
    env = {
        "KVRELAY_DISAGGREGATION__TRANSPORT": transport,
        "KVRELAY_DISAGGREGATION__TRANSFER_TIMEOUT_MS": "120000",
    }
    workers = {role: fleet.worker(f"{tag}-{role}", role, threads, env) for role in ("prefill", "decode")}
    pool = [workers["prefill"], workers["decode"]]
    router_children = {
        name: fleet.router(f"{tag}-router-{i}", pool, {**env, **extra})
        for i, (name, extra) in enumerate(routers.items())
    }
    children = [*pool, *router_children.values()]
    stack = Stack({n: c.address for n, c in router_children.items()}, workers, children)
    with _stopped_on_error(fleet, stack):
        wait_healthy(stack.children)
        for address in stack.routers.values():
            wait_router_sees(fleet, address, ["decode", "prefill"])
    return stack


def start_colocated(fleet: Fleet, tag: str, threads: int) -> Stack:
    worker = fleet.worker(f"{tag}-colocated", "colocated", threads, {})
    router = fleet.router(f"{tag}-router", [worker], {})
    stack = Stack({"default": router.address}, {"colocated": worker}, [worker, router])
    with _stopped_on_error(fleet, stack):
        wait_healthy(stack.children)
        wait_router_sees(fleet, router.address, ["colocated"])
    return stack


@contextlib.contextmanager
def _stopped_on_error(fleet: Fleet, stack: Stack) -> Iterator[None]:
    """A stack that does not come up is stopped at once, so it takes no CPU from the next one."""
    try:
        yield
    except BaseException:
        fleet.stop(stack.children)
        raise


def vocab_size(fleet: Fleet, address: str) -> int:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Info(pb.InfoRequest(), metadata=fleet.metadata, timeout=10)
    return int(info.vocab_size)
