"""The processes of `kvrelay bench transfer`: workers and routers on free loopback ports.

Every stack is a `SupervisedStack` (services/bench/spawn.py): `kvrelay worker` and `kvrelay router`
children under `kvrelay up`'s supervisor, with one random internal token for the whole run and each
child's output in `<logs>/<name>.log`. `Fleet.stop_all` runs in the bench's `finally`, so no process
outlives the bench, on Ctrl-C or SIGTERM too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.bench.spawn import SupervisedStack, bench_env, grpc_spec
from services.common.local_stack import INTERNAL_HOST, free_ports
from services.common.supervisor import Role, ServiceSpec
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]
CHILD_GRACE_S = "5"


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of the run shares (sent as KVRELAY_* environment overrides)."""

    model: Path
    dtype: str
    kv_cache_mb: int


@dataclass
class Stack:
    """One serving setup: its routers by name (address), and its workers' log files by role."""

    routers: dict[str, str]
    worker_logs: dict[str, Path]
    services: SupervisedStack | None = field(default=None, repr=False)

    def log_tail(self, role: str, chars: int = 3000) -> str:
        try:
            return self.worker_logs[role].read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Fleet:
    """Every stack of one bench run, for one stop in the end."""

    def __init__(self, logs: Path, token: str, settings: WorkerSettings) -> None:
        self.logs = logs
        self.token = token
        self.settings = settings
        self.stacks: list[Stack] = []
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        return bench_env() | {
            "KVRELAY_INTERNAL_TOKEN": self.token,
            "KVRELAY_MODEL__DTYPE": self.settings.dtype,
            "KVRELAY_ENGINE__KV_CACHE_MEMORY_MB": str(self.settings.kv_cache_mb),
            **extra,
        }

    def worker(self, name: str, role: str, threads: int, env: dict[str, str], port: int) -> ServiceSpec:
        model = str(self.settings.model.resolve())
        args = [
            *("worker", "--role", role, "--model", model, "--threads", str(threads)),
            *("--name", name, "--grace-seconds", CHILD_GRACE_S),
        ]
        return grpc_spec(name, Role.WORKER, args, self._env(env), port, self.logs)

    def router(self, name: str, workers: list[str], env: dict[str, str], port: int) -> ServiceSpec:
        args = ["router", "--workers", ",".join(workers), "--grace-seconds", CHILD_GRACE_S]
        return grpc_spec(name, Role.ROUTER, args, self._env(env), port, self.logs)

    def start(self, stack: Stack, specs: list[ServiceSpec]) -> None:
        """Run `specs` as `stack`'s services, until every one is healthy (else stopped, and raised)."""
        stack.services = SupervisedStack(specs).start()
        self.stacks.append(stack)

    def stop(self, stack: Stack) -> None:
        if stack.services is not None:
            stack.services.stop()
        if stack in self.stacks:
            self.stacks.remove(stack)

    def stop_all(self) -> None:
        for stack in list(self.stacks):
            self.stop(stack)


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
    ports = free_ports(2 + len(routers))
    workers = {
        role: fleet.worker(f"{tag}-{role}", role, threads, env, port)
        for role, port in zip(("prefill", "decode"), ports, strict=False)
    }
    pool = [f"{INTERNAL_HOST}:{spec.port}" for spec in workers.values()]
    router_specs = {
        name: fleet.router(f"{tag}-router-{i}", pool, {**env, **extra}, port)
        for i, ((name, extra), port) in enumerate(zip(routers.items(), ports[2:], strict=True))
    }
    stack = Stack(
        {name: f"{INTERNAL_HOST}:{spec.port}" for name, spec in router_specs.items()},
        {role: fleet.logs / f"{spec.name}.log" for role, spec in workers.items()},
    )
    fleet.start(stack, [*workers.values(), *router_specs.values()])
    with _stopped_on_error(fleet, stack):
        for address in stack.routers.values():
            wait_router_sees(fleet, address, ["decode", "prefill"])
    return stack


def start_colocated(fleet: Fleet, tag: str, threads: int) -> Stack:
    worker_port, router_port = free_ports(2)
    worker = fleet.worker(f"{tag}-colocated", "colocated", threads, {}, worker_port)
    router = fleet.router(f"{tag}-router", [f"{INTERNAL_HOST}:{worker_port}"], {}, router_port)
    stack = Stack(
        {"default": f"{INTERNAL_HOST}:{router_port}"}, {"colocated": fleet.logs / f"{worker.name}.log"}
    )
    fleet.start(stack, [worker, router])
    with _stopped_on_error(fleet, stack):
        wait_router_sees(fleet, stack.routers["default"], ["colocated"])
    return stack


@contextlib.contextmanager
def _stopped_on_error(fleet: Fleet, stack: Stack) -> Iterator[None]:
    """A stack that does not come up is stopped at once, so it takes no CPU from the next one."""
    try:
        yield
    except BaseException:
        fleet.stop(stack)
        raise


def vocab_size(fleet: Fleet, address: str) -> int:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Info(pb.InfoRequest(), metadata=fleet.metadata, timeout=10)
    return int(info.vocab_size)
