"""What the benchmark tests share: running `kvrelay` as a child of the test, and checking afterwards that
no process of a run is left (none still holds one of its log files open)."""

from __future__ import annotations

import subprocess
import sys
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


def no_process_holds_open(directory: Path) -> bool:
    """No process has a file under `directory` open: every process that logged there is gone."""
    directory = directory.resolve()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            targets = [str(p.readlink()) for p in fd_dir.iterdir()]
        except OSError:
            continue
        if any(t.startswith(str(directory)) for t in targets):
            return False
    return True
