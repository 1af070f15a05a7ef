"""The supervisor with tiny fake services (`python -c` scripts): start order, restarts, config errors, stop.

Each fake appends `<monotonic time> <name> <event> <pid>` lines to a shared events.log and writes
`<name>.ready` once "warmed up"; its health check is that file. Its liveness fails while `<name>.stuck`
exists (a fresh start removes it).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from services.common.errors import CONFIG_EXIT_CODE
from services.common.supervisor import RestartPolicy, Role, ServiceSpec, Supervisor, SupervisorOptions
from tests.conftest import REPO_ROOT

FAKE_SERVICE = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    name, out = os.environ["FAKE_NAME"], pathlib.Path(os.environ["FAKE_DIR"])
    def record(event):
        with open(out / "events.log", "a") as f:
            f.write(f"{time.monotonic():.6f} {name} {event} {os.getpid()}\\n")
    (out / f"{name}.ready").unlink(missing_ok=True)
    (out / f"{name}.stuck").unlink(missing_ok=True)
    starts = out / f"{name}.starts"
    num_starts = int(starts.read_text()) + 1 if starts.exists() else 1
    starts.write_text(str(num_starts))
    record("start")
    print(f"{name} out {num_starts}", flush=True)
    print(f"{name} err {num_starts}", file=sys.stderr, flush=True)
    if num_starts <= int(os.environ.get("FAKE_CRASHES", "0")):
        record("crash")
        sys.exit(int(os.environ.get("FAKE_EXIT_CODE", "1")))
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: (record("term"), sys.exit(0)))
    time.sleep(float(os.environ.get("FAKE_READY_AFTER", "0.2")))
    (out / f"{name}.ready").write_text(str(os.getpid()))
    record("ready")
    while True:
        time.sleep(0.05)
""")

FAST = SupervisorOptions(grace_s=5.0, startup_timeout_s=30.0, poll_interval_s=0.02, probe_interval_s=0.05)


@dataclass(frozen=True)
class FileExists:
    path: Path

    def is_healthy(self) -> bool:
        return self.path.exists()


@dataclass(frozen=True)
class FileAbsent:
    path: Path

    def is_healthy(self) -> bool:
        return not self.path.exists()


@dataclass(frozen=True)
class Event:
    time: float
    name: str
    kind: str
    pid: int


def fake_spec(out: Path, name: str, role: Role, **behaviour: str) -> ServiceSpec:
    env = {**os.environ, "FAKE_NAME": name, "FAKE_DIR": str(out), **behaviour}
    argv = [sys.executable, "-c", FAKE_SERVICE]
    ready, stuck = FileExists(out / f"{name}.ready"), FileAbsent(out / f"{name}.stuck")
    return ServiceSpec(name, role, argv, env, port=0, health=ready, liveness=stuck)


def stack_specs(out: Path, **by_name: dict[str, str]) -> list[ServiceSpec]:
    """codec, router and two workers (listed out of order: the supervisor sorts them)."""
    roles = {"codec": Role.CODEC, "router": Role.ROUTER, "worker-0": Role.WORKER, "worker-1": Role.WORKER}
    return [fake_spec(out, name, role, **by_name.get(name, {})) for name, role in roles.items()]


def events(out: Path) -> list[Event]:
    lines = (out / "events.log").read_text().splitlines()
    parsed = [line.split() for line in lines]
    return [Event(float(t), name, kind, int(pid)) for t, name, kind, pid in parsed]


def index_of(log: list[Event], name: str, kind: str) -> int:
    return next(i for i, e in enumerate(log) if e.name == name and e.kind == kind)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@dataclass
class Running:
    supervisor: Supervisor
    thread: threading.Thread
    ready: threading.Event
    exit_codes: list[int]

    def stop(self) -> int:
        self.supervisor.request_stop()
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()
        return self.exit_codes[0]


@pytest.fixture
def run_in_thread() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(specs: list[ServiceSpec], options: SupervisorOptions = FAST) -> Running:
        ready = threading.Event()
        supervisor = Supervisor(specs, options, on_ready=ready.set)
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(supervisor.supervise()), daemon=True)
        running = Running(supervisor, thread, ready, codes)
        started.append(running)
        thread.start()
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.stop()


def test_starts_each_tier_after_the_one_before_is_healthy_and_stops_codec_first(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    running = run_in_thread(stack_specs(tmp_path))
    assert running.ready.wait(20)
    pids = running.supervisor.pids()
    assert set(pids) == {"worker-0", "worker-1", "router", "codec"}
    assert running.stop() == 0
    log = events(tmp_path)
    for worker in ("worker-0", "worker-1"):
        assert index_of(log, worker, "ready") < index_of(log, "router", "start")
    assert index_of(log, "router", "ready") < index_of(log, "codec", "start")
    assert index_of(log, "codec", "term") < index_of(log, "router", "term")
    assert index_of(log, "router", "term") < min(index_of(log, w, "term") for w in ("worker-0", "worker-1"))
    assert not any(is_alive(pid) for pid in pids.values())


def test_restarts_a_child_that_crashes_at_startup_with_doubling_backoff(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    policy = RestartPolicy(initial_delay_s=0.2, max_delay_s=0.4, reset_after_s=60.0)
    options = SupervisorOptions(grace_s=5.0, poll_interval_s=0.02, probe_interval_s=0.05, restart=policy)
    running = run_in_thread(stack_specs(tmp_path, **{"worker-1": {"FAKE_CRASHES": "3"}}), options)
    assert running.ready.wait(20)
    assert running.supervisor.num_starts() == {"worker-0": 1, "worker-1": 4, "router": 1, "codec": 1}
    starts = [e.time for e in events(tmp_path) if e.name == "worker-1" and e.kind == "start"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert len(gaps) == 3
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.4  # 0.2, doubled, capped at 0.4
    assert running.stop() == 0


def test_a_child_with_a_log_path_appends_stdout_and_stderr_there_across_restarts(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    policy = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.1, reset_after_s=60.0)
    options = SupervisorOptions(grace_s=5.0, poll_interval_s=0.02, probe_interval_s=0.05, restart=policy)
    log = tmp_path / "logs" / "worker-1.log"
    log.parent.mkdir()
    specs = stack_specs(tmp_path, **{"worker-1": {"FAKE_CRASHES": "1"}})
    running = run_in_thread([replace(s, log_path=log) if s.name == "worker-1" else s for s in specs], options)
    assert running.ready.wait(20)
    assert running.stop() == 0
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted(["worker-1 out 1", "worker-1 err 1", "worker-1 out 2", "worker-1 err 2"])
    assert list(log.parent.iterdir()) == [log]  # the other children's output went elsewhere


def test_restarts_a_running_child_that_is_killed(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    running = run_in_thread(stack_specs(tmp_path))
    assert running.ready.wait(20)
    old_pid = running.supervisor.pids()["worker-0"]
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: running.supervisor.pids().get("worker-0", old_pid) != old_pid)
    wait_for(lambda: (tmp_path / "worker-0.ready").exists())
    assert running.supervisor.num_starts()["worker-0"] == 2
    assert running.supervisor.num_starts()["router"] == 1
    assert running.stop() == 0


def test_kills_and_restarts_a_child_that_fails_liveness_probes_in_a_row(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    options = SupervisorOptions(
        grace_s=5.0,
        poll_interval_s=0.02,
        probe_interval_s=0.05,
        liveness_interval_s=0.1,
        num_liveness_failures=3,
    )
    running = run_in_thread(stack_specs(tmp_path), options)
    assert running.ready.wait(20)
    old_pid = running.supervisor.pids()["router"]
    stuck_at = time.monotonic()
    (tmp_path / "router.stuck").touch()
    wait_for(lambda: running.supervisor.pids().get("router", old_pid) != old_pid)
    assert time.monotonic() - stuck_at >= 0.2  # three failed probes 0.1 s apart, not one
    assert not is_alive(old_pid)
    assert running.supervisor.num_starts()["router"] == 2
    assert running.stop() == 0


def test_a_config_error_exit_stops_everything_and_is_never_restarted(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    behaviour = {"FAKE_CRASHES": "99", "FAKE_EXIT_CODE": str(CONFIG_EXIT_CODE)}
    running = run_in_thread(stack_specs(tmp_path, router=behaviour))
    running.thread.join(timeout=20)
    assert running.exit_codes == [CONFIG_EXIT_CODE]
    assert not running.ready.is_set()
    assert running.supervisor.num_starts() == {"worker-0": 1, "worker-1": 1, "router": 1, "codec": 0}
    worker_pids = {e.pid for e in events(tmp_path) if e.name.startswith("worker")}
    assert worker_pids and not any(is_alive(pid) for pid in worker_pids)


def test_startup_gives_up_when_a_service_never_gets_healthy(
    tmp_path: Path, run_in_thread: Callable[..., Running]
) -> None:
    options = SupervisorOptions(
        grace_s=5.0, startup_timeout_s=1.0, poll_interval_s=0.02, probe_interval_s=0.05
    )
    running = run_in_thread(stack_specs(tmp_path, router={"FAKE_READY_AFTER": "60"}), options)
    running.thread.join(timeout=20)
    assert running.exit_codes == [1]
    assert not any(is_alive(e.pid) for e in events(tmp_path))


SUPERVISOR_SCRIPT = textwrap.dedent("""
    import pathlib, sys
    from services.common.supervisor import Supervisor, SupervisorOptions
    from tests.unit.test_supervisor import stack_specs
    out = pathlib.Path(sys.argv[1])
    specs = stack_specs(out, **{"worker-0": {"FAKE_IGNORE_TERM": "1"}})
    options = SupervisorOptions(grace_s=1.0, poll_interval_s=0.02, probe_interval_s=0.05)
    supervisor = Supervisor(specs, options, on_ready=lambda: (out / "up").write_text("ready"))
    sys.exit(supervisor.run())
""")


def test_sigterm_to_the_supervisor_stops_every_child_and_kills_stubborn_ones(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, str(tmp_path)], cwd=REPO_ROOT)
    try:
        wait_for(lambda: (tmp_path / "up").exists(), timeout_s=30)
        pids = {e.name: e.pid for e in events(tmp_path) if e.kind == "start"}
        assert all(is_alive(pid) for pid in pids.values())
        proc.send_signal(signal.SIGTERM)
        stop_started = time.monotonic()
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - stop_started >= 1.0  # the grace period, waiting for the stubborn worker
    finally:
        if proc.poll() is None:
            proc.kill()
    kinds = {e.name for e in events(tmp_path) if e.kind == "term"}
    assert kinds == {"codec", "router", "worker-1"}  # worker-0 ignored SIGTERM: it was SIGKILLed
    assert not any(is_alive(pid) for pid in pids.values())


def test_backoff_starts_at_half_a_second_doubles_to_thirty_and_resets_after_a_minute_up() -> None:
    policy = RestartPolicy()
    delays: list[float] = []
    previous: float | None = None
    for _ in range(9):
        previous = policy.next_delay(previous, uptime_s=1.0)
        delays.append(previous)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert policy.next_delay(30.0, uptime_s=59.9) == 30.0
    assert policy.next_delay(30.0, uptime_s=60.0) == 0.5
