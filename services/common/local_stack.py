"""The whole stack on one machine, as `kvrelay up` (services/cli/up.py) and the benchmarks' stacks
(services/bench/spawn.py) plan it: worker slots per mode, ports, the thread split, the children's
environment and config, and their command lines with their health probes, ready for the supervisor
(services/common/supervisor.py). Nothing here starts a process. Torch-free.

Two shapes: colocated, N workers that each prefill and decode; and disaggregated, P prefill workers then M
decode workers, which the router pairs per request. Every worker gets `--role` and an even share of the
cores (`threads_per_worker`).

Ports come from one base: codec = base (the public HTTP port), router = base + 1, worker i = base + 2 + i
(in disaggregated mode the prefill workers come first, then the decode ones); base 0 takes a free port
for each. Internal services listen on 127.0.0.1 only. A random internal token reaches the children
through the environment (KVRELAY_INTERNAL_TOKEN): never on argv, never logged. Every child reads the
same validated config file (`write_stack_config`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from services.common.config import KvrelayConfig, TlsConfig, dump_config
from services.common.errors import KvrelayError
from services.common.probes import LIVENESS_SERVICE, GrpcHealthCheck, HttpReadyCheck
from services.common.supervisor import Role, ServiceSpec

COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"
MODES = (COLOCATED, DISAGGREGATED)
AUTO = "auto"
# `--mode auto` disaggregates from this many cores up. Below it, 1 prefill + 1 decode worker would each get
# 1 thread on 2 cores, which costs a single stream's decode ~1.3x against one colocated worker on both
# (docs/performance.md, "The whole stack on one machine"); P/D's isolation of decode from long prompts pays
# off where each pool keeps at least 2 threads.
DISAGGREGATE_FROM_CORES = 4
PREFILL = "prefill"
DECODE = "decode"
INTERNAL_HOST = "127.0.0.1"
TOKEN_ENV = "KVRELAY_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "KVRELAY_INTERNAL_TOKEN_FILE"
MAX_PORT = 65535
LIVENESS_TIMEOUT_S = 2.0


class UpError(KvrelayError):
    """The stack cannot start as asked (by `kvrelay up`'s flags or a benchmark's settings): an unknown
    mode, a bad worker count, a count flag of the other mode, busy ports (services/cli/up.py checks)."""


class WorkerSlot(NamedTuple):
    """One worker process of the stack: its service name and its `kvrelay worker --role`."""

    name: str
    role: str


@dataclass(frozen=True)
class StackPorts:
    codec: int
    router: int
    workers: tuple[int, ...]
    worker_names: tuple[str, ...] = ()  # one per worker port; empty means worker-0, worker-1, ...

    @property
    def names(self) -> tuple[str, ...]:
        """The workers' service names, in port order."""
        return self.worker_names or tuple(f"worker-{i}" for i in range(len(self.workers)))

    def all(self) -> list[tuple[str, int]]:
        """(service name, port) for every service, in start order."""
        named = list(zip(self.names, self.workers, strict=True))
        return [*named, ("router", self.router), ("codec", self.codec)]


@dataclass(frozen=True)
class StackPlan:
    """Everything the child command lines are built from."""

    host: str
    ports: StackPorts
    config_path: Path
    model_dir: Path
    threads_per_worker: int
    env: Mapping[str, str]
    grpc_port: int | None = None  # the codec's public gRPC API (off when None)
    mode: str = COLOCATED
    worker_roles: tuple[str, ...] = ()  # one per worker port; empty means every worker is colocated
    tls: TlsConfig | None = None  # internal mutual TLS, for the health probes
    drain: bool = False  # the codec also runs queued background responses (queue.url is set)

    def workers(self) -> list[WorkerSlot]:
        """Name and role of every worker, in port order."""
        roles = self.worker_roles or (COLOCATED,) * len(self.ports.workers)
        return [WorkerSlot(n, r) for n, r in zip(self.ports.names, roles, strict=True)]


def plan_workers(
    mode: str,
    workers: int | None = None,
    prefill_replicas: int | None = None,
    decode_replicas: int | None = None,
) -> list[WorkerSlot]:
    """The workers of a `mode` stack, in port order. Colocated: `workers` (default 1) named worker-i.
    Disaggregated: prefill-i then decode-j (1 of each by default). A count flag of the other mode, an
    unknown mode or a count below 1 is an UpError."""
    if mode == COLOCATED:
        _reject_flags(mode, {"--prefill-replicas": prefill_replicas, "--decode-replicas": decode_replicas})
        num_workers = _count("--workers", workers)
        return [WorkerSlot(f"worker-{i}", COLOCATED) for i in range(num_workers)]
    if mode == DISAGGREGATED:
        _reject_flags(mode, {"--workers": workers})
        num_prefill = _count("--prefill-replicas", prefill_replicas)
        num_decode = _count("--decode-replicas", decode_replicas)
        return [WorkerSlot(f"{PREFILL}-{i}", PREFILL) for i in range(num_prefill)] + [
            WorkerSlot(f"{DECODE}-{i}", DECODE) for i in range(num_decode)
        ]
    raise UpError(
        f"--mode {mode} is not a deployment shape: pick colocated (each worker prefills and decodes) "
        "or disaggregated (prefill workers and decode workers)"
    )


def _count(flag: str, value: int | None) -> int:
    """A worker count: 1 when not given, else at least 1."""
    if value is None:
        return 1
    if value < 1:
        raise UpError(f"{flag} must be at least 1, got {value}")
    return value


def _reject_flags(mode: str, flags: Mapping[str, int | None]) -> None:
    """Count flags that belong to the other mode are an error, not silently ignored."""
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return
    hint = (
        "colocated workers are counted by --workers"
        if mode == COLOCATED
        else "it counts prefill and decode workers with --prefill-replicas and --decode-replicas"
    )
    raise UpError(f"--mode {mode} does not take {', '.join(given)}: {hint}")


def derive_ports(
    base_port: int,
    num_workers: int,
    free_ports: Callable[[int], list[int]],
    worker_names: tuple[str, ...] = (),
) -> StackPorts:
    """codec = base, router = base + 1, worker i = base + 2 + i; base 0 asks `free_ports` for them all.
    `worker_names`, when given, names the workers (one per worker) in errors and logs."""
    if num_workers < 1:
        raise UpError(f"--workers must be at least 1, got {num_workers}")
    if worker_names and len(worker_names) != num_workers:
        raise ValueError(f"{len(worker_names)} worker names for {num_workers} workers")
    num_ports = num_workers + 2
    if base_port == 0:
        ports = free_ports(num_ports)
    elif base_port >= 1 and base_port + num_ports - 1 <= MAX_PORT:
        ports = list(range(base_port, base_port + num_ports))
    else:
        raise UpError(
            f"--port {base_port} leaves no room for {num_ports} ports (codec, router, {num_workers} "
            f"worker(s)) below {MAX_PORT + 1}; pick a lower port or 0 for free ones"
        )
    return StackPorts(codec=ports[0], router=ports[1], workers=tuple(ports[2:]), worker_names=worker_names)


def threads_per_worker(num_cores: int, num_workers: int) -> int:
    """An even split of the cores over every worker, whatever its role, so the workers' threads add up to
    at most the cores (at least 1). Prefill and decode get equal shares: prefill is compute-bound but
    runs once per request, decode runs every step; 1 prefill + 1 decode on 2 cores is 1 thread each."""
    return max(1, num_cores // num_workers)


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_ports(count: int, host: str = INTERNAL_HOST) -> list[int]:
    """`count` distinct ports the OS calls free now (all held open together, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def child_env(base_env: Mapping[str, str], token: str) -> dict[str, str]:
    """The children's environment: ours, with the stack's token replacing any token file setting."""
    env = {k: v for k, v in base_env.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env[TOKEN_ENV] = token
    return env


KVRELAY_MODULE = "services.cli.main"  # the `kvrelay` command, run as `python -m` by every child


def kvrelay_argv(*args: str, python: str = sys.executable) -> list[str]:
    """A `kvrelay ARGS` command line for `python` (`python -m services.cli.main ARGS`), so no child needs
    the `kvrelay` script on PATH."""
    return [python, "-m", KVRELAY_MODULE, *args]


def build_specs(plan: StackPlan, python: str = sys.executable) -> list[ServiceSpec]:
    """Workers, router and codec as the supervisor runs them (`python -m services.cli.main ...`)."""
    config = {"--config": str(plan.config_path)}
    model = {"--model": str(plan.model_dir)}
    worker_addresses = [f"{INTERNAL_HOST}:{port}" for port in plan.ports.workers]
    router_address = f"{INTERNAL_HOST}:{plan.ports.router}"
    specs = []
    for (name, role), port, address in zip(plan.workers(), plan.ports.workers, worker_addresses, strict=True):
        flags = {
            **config,
            **model,
            "--role": role,
            **_listen(INTERNAL_HOST, port),
            "--threads": str(plan.threads_per_worker),
            "--name": name,
        }
        argv = kvrelay_argv("worker", *_flatten(flags), python=python)
        liveness = GrpcHealthCheck(
            address, timeout_s=LIVENESS_TIMEOUT_S, service=LIVENESS_SERVICE, tls=plan.tls
        )
        readiness = GrpcHealthCheck(address, tls=plan.tls)
        specs.append(ServiceSpec(name, Role.WORKER, argv, plan.env, port, readiness, liveness))
    flags = {**config, **_listen(INTERNAL_HOST, plan.ports.router), "--workers": ",".join(worker_addresses)}
    argv = kvrelay_argv("router", *_flatten(flags), python=python)
    specs.append(
        ServiceSpec(
            "router",
            Role.ROUTER,
            argv,
            plan.env,
            plan.ports.router,
            GrpcHealthCheck(router_address, tls=plan.tls),
        )
    )
    flags = {**config, **model, "--router": router_address, **_listen(plan.host, plan.ports.codec)}
    if plan.grpc_port:
        flags["--grpc-port"] = str(plan.grpc_port)
    argv = kvrelay_argv("codec", *_flatten(flags), *(["--drain"] if plan.drain else []), python=python)
    ready = HttpReadyCheck(f"{public_url(_probe_host(plan.host), plan.ports.codec)}/ready")
    specs.append(ServiceSpec("codec", Role.CODEC, argv, plan.env, plan.ports.codec, ready))
    return specs


def _listen(host: str, port: int) -> dict[str, str]:
    return {"--host": host, "--port": str(port)}


def _flatten(flags: Mapping[str, str]) -> list[str]:
    return [part for flag, value in flags.items() for part in (flag, value)]


def public_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolve_mode(mode: str, num_cores: int) -> str:
    """`--mode` with auto resolved: disaggregated from DISAGGREGATE_FROM_CORES cores up, else colocated."""
    if mode != AUTO:
        return mode
    return DISAGGREGATED if num_cores >= DISAGGREGATE_FROM_CORES else COLOCATED


def write_stack_config(directory: Path, cfg: KvrelayConfig, model_dir: Path, host: str, port: int) -> Path:
    """`cfg` with the stack's model directory and public address, as `directory`/config.yaml: the one
    config every child reads."""
    model = cfg.model.model_copy(update={"path": str(model_dir)})
    server = cfg.server.model_copy(update={"host": host, "port": port})
    path = directory / "config.yaml"
    path.write_text(dump_config(cfg.model_copy(update={"model": model, "server": server})))
    return path


def _probe_host(host: str) -> str:
    """Where to reach a server bound to `host`: a wildcard address is probed through loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
