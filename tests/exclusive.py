"""Running the suite on both cores (pytest-xdist) without a test ever losing the machine it was written for.

`make test` runs two pytest workers, each with one torch/OpenMP thread. Most tests only wait on conditions
and do not mind a neighbour. A test marked `exclusive` (a deadline, a timeout it provokes on purpose, a
wait whose length depends on how fast the machine computes) must not share the cores: it runs only while
no other test runs, and with every core's thread, as it did when the suite ran one test at a time.

How: every test's whole run, its setup and teardown included (so a module's stack starting or stopping
too), holds a lock that all workers share: shared for ordinary tests, exclusive for marked ones. A gate
taken before either makes an exclusive test wait only for the tests already running: no new shared holder
gets in ahead of it, so it is never starved.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

LOCK_DIR_ENV = "KVRELAY_TEST_LOCK_DIR"


class MachineLock:
    """This worker's side of the lock in `lock_dir` (made by the controller, shared by every worker)."""

    def __init__(self, lock_dir: Path) -> None:
        self._gate: IO[str] = (lock_dir / "gate").open("a+")
        self._machine: IO[str] = (lock_dir / "machine").open("a+")

    @contextmanager
    def held(self, *, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._machine, fcntl.LOCK_UN)


@contextmanager
def all_cores() -> Iterator[None]:
    """Every core's thread for this process's torch and for the processes it starts meanwhile; the
    worker's own count (OMP_NUM_THREADS) back afterwards."""
    before = os.environ.get("OMP_NUM_THREADS")
    num_cores = str(os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = num_cores
    _set_torch_threads(num_cores)
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
            _set_torch_threads(before)


def _set_torch_threads(count: str) -> None:
    torch = sys.modules.get("torch")  # loaded by an earlier test, or by this one meanwhile
    if torch is not None:
        torch.set_num_threads(int(count))
