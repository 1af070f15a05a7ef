"""What the benchmark tests share: running `kvrelay` as a child of the test, and checking afterwards that
no process of a run is left (none still holds one of its log files open)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT


def run_kvrelay(args: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """`kvrelay ARGS` (this interpreter, `-m services.cli.main`) to its end, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def processes_holding_open(directory: Path) -> list[str]:
    """The command lines of processes with a file under `directory` open."""
    directory = directory.resolve()
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            targets = [str(p.readlink()) for p in fd_dir.iterdir()]
            if any(t.startswith(str(directory)) for t in targets):
                holders.append((fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue
    return holders


def no_process_holds_open(directory: Path, timeout_s: float = 15.0) -> bool:
    """No process has a file under `directory` open: every process that logged there is gone. Waits up to
    `timeout_s` for that: a worker's torch shared-memory manager (a grandchild, started at worker start for
    the ipc transport, inheriting its log file) exits on its own about two seconds after its last client."""
    deadline = time.monotonic() + timeout_s
    while holders := processes_holding_open(directory):
        if time.monotonic() > deadline:
            print("still open by:", *holders, sep="\n  ")
            return False
        time.sleep(0.1)
    return True
