"""The stacks of `kvrelay bench routing`: one `kvrelay up --mode colocated` per policy, never two at once.

`kvrelay up --port 0` runs in its own session with its output in a log file; its URL comes from the
`kvrelay ready on URL` line. `UpStack.stop` sends SIGTERM (up stops its children itself) and waits; if
up does not exit in time, up and every child it started (found by parent PID in /proc before the
stop) are SIGKILLed by process group, so no process outlives the bench.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.cli.status import StackUnreachableError, fetch_status

REPO_ROOT = Path(__file__).resolve().parents[2]
ANNOUNCED = re.compile(r"kvrelay ready on (http://\S+)")
START_TIMEOUT_S = 300.0
GRACE_S = 10.0
WORKER_ROLES = ("colocated", "decode")


@dataclass(frozen=True)
class StackSettings:
    model: Path
    workers: int
    kv_cache_mb: int
    max_model_len: int


def write_config(path: Path, policy: str, settings: StackSettings) -> Path:
    path.write_text(
        f"engine:\n  kv_cache_memory_mb: {settings.kv_cache_mb}\n  max_model_len: {settings.max_model_len}\n"
        f"router:\n  policy: {policy}\n"
    )
    return path


@dataclass
class UpStack:
    popen: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def children(self) -> list[int]:
        """PIDs of the processes whose parent is `kvrelay up` (its services), from /proc."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.popen.pid:
                found.append(int(entry.name))
        return found

    def stop(self) -> int:
        """SIGTERM up and wait; past the grace period (plus slack) SIGKILL it and its children."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            children = self.children()
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(GRACE_S + 20)
            except subprocess.TimeoutExpired:
                for pid in [self.popen.pid, *children]:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                self.popen.wait()
            return self.popen.returncode
        finally:
            signal.signal(signal.SIGINT, previous)


def start_up(settings: StackSettings, config: Path, log_path: Path) -> UpStack:
    """`kvrelay up --mode colocated --workers N --port 0`, waited on until it announces its URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")} | {"PYTHONUNBUFFERED": "1"}
    argv = [
        *(sys.executable, "-m", "services.cli.main", "up", "--mode", "colocated"),
        *("--workers", str(settings.workers), "--port", "0", "--config", str(config)),
        *("--model", str(settings.model.resolve()), "--grace-seconds", str(GRACE_S)),
    ]
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack = UpStack(popen, log_path)
    try:
        stack.url = _wait_announced(stack)
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait_announced(stack: UpStack) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        found = ANNOUNCED.search(stack.log_text())
        if found:
            return found.group(1)
        if stack.popen.poll() is not None:
            raise RuntimeError(
                f"kvrelay up exited with {stack.popen.returncode}:\n{stack.log_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"kvrelay up not ready after {START_TIMEOUT_S:.0f} s:\n{stack.log_text()[-3000:]}"
            )
        time.sleep(0.3)


def worker_counters(url: str) -> dict[str, dict[str, int]]:
    """Per worker (from `kvrelay status --json`'s document): requests served and prefix-cache tokens."""
    try:
        services = fetch_status(url)["services"]
    except StackUnreachableError:
        return {}
    return {
        str(s["name"]): {
            "requests": int(s.get("requests_total") or 0),
            "prefix_queries": int((s.get("prefix_cache") or {}).get("queries") or 0),
            "prefix_hits": int((s.get("prefix_cache") or {}).get("hits") or 0),
        }
        for s in services
        if s.get("role") in WORKER_ROLES
    }


def counter_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {
        name: {key: value - before.get(name, {}).get(key, 0) for key, value in counts.items()}
        for name, counts in sorted(after.items())
    }


def routing_reasons(log_text: str) -> dict[str, int]:
    """How the router placed each request it finished: the `reason` of its `routed` log lines."""
    reasons: Counter[str] = Counter()
    for line in log_text.splitlines():
        if '"routed"' not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "routed":
            reasons[str(entry.get("reason"))] += 1
    return dict(sorted(reasons.items()))
