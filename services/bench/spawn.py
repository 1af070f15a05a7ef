"""The stacks a benchmark starts, run by `kvrelay up`'s own supervisor (services/common/supervisor.py).

A `SupervisedStack` runs one `Supervisor` in a background thread: it starts the services in dependency
order (workers, router, codec), waits for each tier's health, and on `stop` SIGTERMs them tier by tier,
SIGKILLing what outlives the grace period. Every child writes its stdout and stderr to its spec's log
file (`<logs>/<service>.log`: emptied when the stack starts, appended to across restarts). Children run
`python -m services.cli.main` with the interpreter the bench runs in, so nothing here needs a path into
a checkout, and get this process's environment without any KVRELAY_* setting (the stack's own config
and token replace them).

The supervisor would restart a child that exits while the stack starts; a benchmark wants the reason
instead, so `start` fails at once, with the log tails, when any child has exited before the stack is
ready. While a stack stops, SIGINT and SIGTERM are ignored (on the main thread), so a second Ctrl-C
cannot leave children behind.

`start_up_stack` is the stack `kvrelay up --port 0` runs (services/common/local_stack.py plans it for both),
with the bench's config; benchmarks with stacks of their own shape pass their specs to `SupervisedStack`.
Nothing here imports the CLI (services/cli/): the children run it as a command.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from services.common.config import load_config
from services.common.local_stack import (
    COLOCATED,
    INTERNAL_HOST,
    TOKEN_ENV,
    StackPlan,
    available_cores,
    build_specs,
    child_env,
    derive_ports,
    free_ports,
    kvrelay_argv,
    plan_workers,
    public_url,
    threads_per_worker,
    write_stack_config,
)
from services.common.probes import GrpcHealthCheck
from services.common.supervisor import Role, ServiceSpec, Supervisor, SupervisorOptions

START_TIMEOUT_S = 300.0
GRACE_S = 10.0
POLL_S = 0.1
LOG_TAIL_CHARS = 3000


def bench_env() -> dict[str, str]:
    """This process's environment without KVRELAY_* settings, with unbuffered child output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    return env | {"PYTHONUNBUFFERED": "1"}


def grpc_spec(name: str, role: Role, args: Sequence[str], env: dict[str, str], port: int, logs: Path
              ) -> ServiceSpec:  # fmt: skip
    """`kvrelay <args> --port <port>` on loopback, healthy once its gRPC health check says SERVING."""
    argv = kvrelay_argv(*args, "--port", str(port))
    health = GrpcHealthCheck(f"{INTERNAL_HOST}:{port}")
    return ServiceSpec(name, role, argv, env, port, health, log_path=logs / f"{name}.log")


class SupervisedStack:
    """`specs` under one Supervisor in a background thread, from `start` until `stop`."""

    def __init__(self, specs: Sequence[ServiceSpec], grace_s: float = GRACE_S) -> None:
        self.specs = list(specs)
        self._ready = threading.Event()
        options = SupervisorOptions(grace_s=grace_s, startup_timeout_s=START_TIMEOUT_S)
        self._supervisor = Supervisor(self.specs, options, on_ready=self._ready.set)
        self._exit_codes: list[int] = []
        self._thread = threading.Thread(target=self._supervise, name="bench-stack", daemon=True)

    def _supervise(self) -> None:
        self._exit_codes.append(self._supervisor.supervise())

    def start(self) -> SupervisedStack:
        """Start every service (each log file emptied first) and wait until all are healthy; on failure
        stop them and raise."""
        for spec in self.specs:
            if spec.log_path is not None:
                spec.log_path.write_bytes(b"")
        self._thread.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        while not self._ready.wait(POLL_S):
            if not self._thread.is_alive():
                code = self._exit_codes[0] if self._exit_codes else None
                raise RuntimeError(f"the stack stopped before it was ready (exit {code}):\n{self.tails()}")
            exited = sorted(name for name, n in self._supervisor.num_starts().items() if n > 1)
            if exited:
                raise RuntimeError(f"{', '.join(exited)} exited while the stack started:\n{self.tails()}")

    def stop(self) -> int:
        """Stop every service (SIGTERM, then SIGKILL past the grace period); the supervisor's exit code."""
        with _stop_signals_ignored():
            self._supervisor.request_stop()
            if self._thread.is_alive():
                self._thread.join()
        return self._exit_codes[0] if self._exit_codes else 0

    def pids(self) -> dict[str, int]:
        return self._supervisor.pids()

    def restarts(self) -> dict[str, int]:
        """How many times the supervisor restarted each service since the stack started."""
        return {name: n - 1 for name, n in self._supervisor.num_starts().items()}

    def log_path(self, name: str) -> Path:
        (spec,) = [s for s in self.specs if s.name == name]
        if spec.log_path is None:
            raise ValueError(f"service {name} has no log file")
        return spec.log_path

    def log_text(self, name: str) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""

    def tails(self) -> str:
        return "\n".join(f"--- {s.name}:\n{self.log_text(s.name)[-LOG_TAIL_CHARS:]}" for s in self.specs)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupted_by(*signals: signal.Signals) -> Iterator[None]:
    """While inside, each of `signals` raises KeyboardInterrupt (main thread only), so the `finally`
    blocks that stop a benchmark's stacks run on SIGTERM as on Ctrl-C."""
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class UpSettings:
    """What `kvrelay up --port 0 --mode M --workers N --config C --model D` is given."""

    model: Path
    config: Path | None  # a kvrelay YAML (None: the defaults); the stack's model and address replace its own
    logs: Path  # the stack's effective config and one log per service go here
    mode: str = COLOCATED
    workers: int | None = None  # colocated workers (1 when None); disaggregated runs 1 prefill + 1 decode
    grace_s: float = GRACE_S


@dataclass
class UpStack:
    """A running `kvrelay up` stack: its public URL, its plan (ports, internal token) and its services."""

    url: str
    plan: StackPlan
    services: SupervisedStack

    @property
    def token(self) -> str:
        return self.plan.env[TOKEN_ENV]

    def stop(self) -> int:
        return self.services.stop()


def up_plan(settings: UpSettings) -> StackPlan:
    """What `kvrelay up --port 0` plans for `settings`: ports, the config file, the thread split, a token."""
    settings.logs.mkdir(parents=True, exist_ok=True)
    cfg = load_config(settings.config, env={})
    workers = plan_workers(settings.mode, settings.workers)
    ports = derive_ports(0, len(workers), free_ports, tuple(w.name for w in workers))
    model_dir = settings.model.resolve()
    return StackPlan(
        host=INTERNAL_HOST,
        ports=ports,
        config_path=write_stack_config(settings.logs, cfg, model_dir, INTERNAL_HOST, ports.codec),
        model_dir=model_dir,
        threads_per_worker=threads_per_worker(available_cores(), len(workers)),
        env=child_env(bench_env(), secrets.token_urlsafe(32)),
        mode=settings.mode,
        worker_roles=tuple(w.role for w in workers),
        tls=cfg.internal_tls,
        drain=cfg.queue.url is not None,  # as `kvrelay up`: the codec drains the queue it is given
    )


def up_specs(plan: StackPlan, logs: Path) -> list[ServiceSpec]:
    """The services of `plan`, each logging to `<logs>/<name>.log`."""
    return [replace(s, log_path=logs / f"{s.name}.log") for s in build_specs(plan)]


def start_up_stack(settings: UpSettings) -> UpStack:
    """The services `kvrelay up` would run for `settings`, started and healthy."""
    plan = up_plan(settings)
    services = SupervisedStack(up_specs(plan, settings.logs), settings.grace_s).start()
    return UpStack(public_url(INTERNAL_HOST, plan.ports.codec), plan, services)
