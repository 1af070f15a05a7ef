"""Compiles kernels.c once per source and compiler, caches the shared library, and loads it.

The library is built with the system C compiler into `~/.cache/kvrelay/ops` (or `$XDG_CACHE_HOME`),
named by a hash of the source, flags and compiler, and written through a temporary file and a rename, so
concurrent processes never see half a library. OpenMP resolves to the libgomp that torch has already
loaded, so the kernels share torch's thread pool instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours is opened)

from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay" / "ops"


def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The compiled CPU kernels, or None (with a warning) where this machine cannot build or run them."""
    if not can_run_cpu_kernels(cpu_flags()):
        log.info("cpu kernels off: the CPU lacks AVX2/FMA")
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not SOURCE.is_file():
        log.warning("cpu kernels off: no C compiler or no kernel source; using the torch path")
        return None
    try:
        library = _build(compiler, cache_dir or default_cache_dir())
        return CpuKernels(ctypes.CDLL(str(library)))
    except subprocess.CalledProcessError as exc:
        log.warning("cpu kernels off: compile failed: %s; using the torch path", exc.stderr[-2000:])
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cpu kernels off: build failed (%s); using the torch path", exc)
        return None


def _build(compiler: str, cache_dir: Path) -> Path:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *CFLAGS)).encode()).hexdigest()[:16]
    target = cache_dir / f"kernels-{digest}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built cpu kernels", extra={"path": str(target)})
    return target
