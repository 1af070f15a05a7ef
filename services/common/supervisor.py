"""Process supervision for `kvrelay up` (services/cli/up.py) and the stacks the benchmarks start
(services/bench/spawn.py): one child process per service, each in its own process group. Torch-free.

Start waits for health in dependency order (workers, then the router, then the codec). A child that
exits is restarted after an exponential backoff, except one that exits with CONFIG_EXIT_CODE (78): a bad
configuration does not get better by retrying, so the supervisor stops everything and exits 78 itself.
On SIGINT or SIGTERM it stops the children in reverse order (codec, router, workers) within one grace
period, SIGKILLs whatever is left, and exits 0. A second signal skips the rest of the grace period.
Once up, a service with a liveness probe that fails several probes in a row is killed, and so restarted.

Children inherit stdout and stderr (they log JSON lines of their own), or append both to their spec's
`log_path` when it has one, and get /dev/null as stdin. Their own process groups keep a terminal's
Ctrl-C from reaching them directly: the supervisor orders the stop.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from services.common.errors import CONFIG_EXIT_CODE, KvrelayError
from services.common.probes import HealthCheck

log = logging.getLogger(__name__)

EXIT_STOPPED = 0
EXIT_STARTUP_FAILED = 1


class SupervisorError(KvrelayError):
    """A child process could not be started at all (for example, its executable does not exist)."""


class Role(enum.Enum):
    WORKER = "worker"
    ROUTER = "router"
    CODEC = "codec"


START_ORDER = (Role.WORKER, Role.ROUTER, Role.CODEC)
STOP_ORDER = tuple(reversed(START_ORDER))


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff: 0.5 s doubling to 30 s, back to 0.5 s once a child has stayed up 60 s."""

    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0

    def next_delay(self, previous_delay_s: float | None, uptime_s: float) -> float:
        """The wait before restarting a child that exited after `uptime_s` seconds up."""
        if previous_delay_s is None or uptime_s >= self.reset_after_s:
            return self.initial_delay_s
        return min(previous_delay_s * 2, self.max_delay_s)


@dataclass(frozen=True)
class ServiceSpec:
    """One child: `env` is its whole environment (nothing is inherited implicitly). `health` says it is
    ready; `liveness`, probed only once it has been ready, says it is not stuck. With `log_path`, the
    child's stdout and stderr are appended to that file (so a restart keeps the earlier output)."""

    name: str
    role: Role
    argv: Sequence[str]
    env: Mapping[str, str]
    port: int
    health: HealthCheck
    liveness: HealthCheck | None = None
    log_path: Path | None = None


@dataclass(frozen=True)
class SupervisorOptions:
    grace_s: float = 30.0
    startup_timeout_s: float = 300.0
    poll_interval_s: float = 0.1
    probe_interval_s: float = 0.25
    liveness_interval_s: float = 5.0
    num_liveness_failures: int = 3  # in a row, before the child is killed
    restart: RestartPolicy = RestartPolicy()


@dataclass
class _Child:
    spec: ServiceSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    last_delay_s: float | None = None
    restart_at: float | None = None
    num_starts: int = 0
    is_warm: bool = False  # ready at least once since its last start
    next_probe_at: float = 0.0
    num_failed_probes: int = 0

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """Runs `specs` until stopped. `on_ready` is called once, when every service is first healthy."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        options: SupervisorOptions | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self._children = [_Child(spec) for spec in sorted(specs, key=lambda s: START_ORDER.index(s.role))]
        self._options = options or SupervisorOptions()
        self._on_ready = on_ready
        self._stopping = threading.Event()
        self._forced = threading.Event()

    def run(self) -> int:
        """`supervise()` with SIGINT and SIGTERM turned into a graceful stop. Main thread only."""
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stop_signals}
        try:
            return self.supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def supervise(self) -> int:
        """Start, watch and finally stop every child. Returns the exit code for the whole stack:
        0 after a requested stop, 78 after a child's config error, 1 if startup timed out."""
        try:
            code = self._start_in_order()
            if code is None:
                if self._on_ready is not None:
                    self._on_ready()
                code = self._watch()
        finally:
            self._stop_all()
        return code

    def request_stop(self) -> None:
        """Ask for a graceful stop; a second request skips the rest of the grace period."""
        if self._stopping.is_set():
            self._forced.set()
        self._stopping.set()

    def pids(self) -> dict[str, int]:
        """The PID of each running child, by service name."""
        return {c.spec.name: c.process.pid for c in self._children if c.process and c.is_running}

    def num_starts(self) -> dict[str, int]:
        """How many times each child has been started (1 + its restarts)."""
        return {c.spec.name: c.num_starts for c in self._children}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("stop requested", extra={"signal": signal.Signals(signum).name})
        self.request_stop()

    def _start_in_order(self) -> int | None:
        deadline = time.monotonic() + self._options.startup_timeout_s
        for role in START_ORDER:
            tier = [c for c in self._children if c.spec.role is role]
            for child in tier:
                self._spawn(child)
            code = self._wait_healthy(tier, deadline)
            if code is not None:
                return code
        return None

    def _wait_healthy(self, tier: list[_Child], deadline: float) -> int | None:
        pending = list(tier)
        while True:
            code = self._tend()
            if code is not None:
                return code
            if self._stopping.is_set():
                return EXIT_STOPPED
            for child in pending:
                child.is_warm = child.is_running and child.spec.health.is_healthy()
            pending = [c for c in pending if not c.is_warm]
            if not pending:
                return None
            if time.monotonic() > deadline:
                names = [c.spec.name for c in pending]
                log.error("services did not become healthy in time", extra={"children": names})
                return EXIT_STARTUP_FAILED
            self._stopping.wait(self._options.probe_interval_s)

    def _watch(self) -> int:
        while not self._stopping.is_set():
            code = self._tend()
            if code is not None:
                return code
            self._probe_due()
            self._stopping.wait(self._options.poll_interval_s)
        return EXIT_STOPPED

    def _probe_due(self) -> None:
        """Readiness for restarted children until they are warm; liveness for warm ones. A child that
        fails `num_liveness_failures` liveness probes in a row is SIGKILLed: `_tend` restarts it."""
        for child in self._children:
            now = time.monotonic()
            if not child.is_running or now < child.next_probe_at:
                continue
            fields = {"child": child.spec.name}
            if not child.is_warm:
                child.next_probe_at = now + self._options.probe_interval_s
                child.is_warm = child.spec.health.is_healthy()
                if child.is_warm:
                    log.info("service is ready", extra={**fields, "start": child.num_starts})
                continue
            child.next_probe_at = now + self._options.liveness_interval_s
            if child.spec.liveness is None or child.spec.liveness.is_healthy():
                child.num_failed_probes = 0
                continue
            child.num_failed_probes += 1
            log.warning(
                "service failed a liveness probe", extra={**fields, "failures": child.num_failed_probes}
            )
            if child.num_failed_probes >= self._options.num_liveness_failures:
                log.error("service is stuck; killing it so that it restarts", extra=fields)
                _signal_group(child, signal.SIGKILL)

    def _tend(self) -> int | None:
        """Reap children that exited and restart those whose backoff is over. Returns 78 after a
        config error (the stack must stop), else None."""
        now = time.monotonic()
        for child in self._children:
            exit_code = child.process.poll() if child.process is not None else None
            if exit_code is not None:
                self._on_exit(child, exit_code, now)
                if exit_code == CONFIG_EXIT_CODE:
                    return CONFIG_EXIT_CODE
            elif child.restart_at is not None and now >= child.restart_at and not self._stopping.is_set():
                self._spawn(child)
        return None

    def _on_exit(self, child: _Child, exit_code: int, now: float) -> None:
        uptime_s = now - child.started_at
        fields = {"child": child.spec.name, "exit_code": exit_code, "uptime_s": round(uptime_s, 3)}
        child.process = None
        if exit_code == CONFIG_EXIT_CODE:
            log.error("service exited with a config error; stopping the stack", extra=fields)
            return
        delay_s = self._options.restart.next_delay(child.last_delay_s, uptime_s)
        child.last_delay_s = delay_s
        child.restart_at = now + delay_s
        log.warning("service exited; restarting it", extra={**fields, "restart_in_s": delay_s})

    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        try:
            with contextlib.ExitStack() as files:
                out = files.enter_context(spec.log_path.open("ab")) if spec.log_path is not None else None
                child.process = subprocess.Popen(
                    list(spec.argv),
                    env=dict(spec.env),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                    start_new_session=True,
                )
        except OSError as exc:
            raise SupervisorError(f"cannot start service {spec.name}: {exc}") from None
        child.started_at = time.monotonic()
        child.restart_at = None
        child.is_warm, child.next_probe_at, child.num_failed_probes = False, 0.0, 0
        child.num_starts += 1
        fields = {"child": spec.name, "role": spec.role.value, "pid": child.process.pid, "port": spec.port}
        log.info("service started", extra={**fields, "start": child.num_starts})

    def _stop_all(self) -> None:
        """SIGTERM tier by tier (codec, router, workers) within one grace period, then SIGKILL."""
        deadline = time.monotonic() + self._options.grace_s
        for role in STOP_ORDER:
            tier = [c for c in self._children if c.spec.role is role and c.is_running]
            for child in tier:
                _signal_group(child, signal.SIGTERM)
            while any(c.is_running for c in tier) and time.monotonic() < deadline:
                if self._forced.wait(self._options.poll_interval_s):
                    break
        for child in self._children:
            child.restart_at = None
            if child.process is None:
                continue
            if child.is_running:
                log.warning("service did not stop in time; killing it", extra={"child": child.spec.name})
                _signal_group(child, signal.SIGKILL)
            exit_code = child.process.wait()
            log.info("service stopped", extra={"child": child.spec.name, "exit_code": exit_code})
            child.process = None


def _signal_group(child: _Child, sig: signal.Signals) -> None:
    """Signal the child's whole process group (its PID is the group ID: start_new_session)."""
    if child.process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.process.pid, sig)
