"""Compiles kernels.c (with the blocks.h it includes) once per source and compiler, caches the shared
library, and loads it.

The library is built with the system C compiler into `~/.cache/kvrelay/ops` (or `$XDG_CACHE_HOME`),
named by a hash of the source, flags and compiler, and written through a temporary file and a rename, so
concurrent processes never see half a library. OpenMP resolves to the libgomp that torch has already
loaded, so the kernels share torch's thread pool instead of starting a second one.

Two outcomes are kept apart. A CPU without AVX2/FMA cannot run the kernels: that is a hardware fact, and
`load_cpu_kernels` returns None so the model takes its torch path. Anything else that stops the kernels
(no C compiler, no kernels.c beside this file, a compile error, a library that does not load) is a broken
install: it raises `KernelBuildError` with the compiler's output, and model load fails with it. There is
no silent fallback, because a shipped kernels.c that does not compile would otherwise run every step on
the slow path without anyone noticing.
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

from services.common.errors import KernelBuildError
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
HEADERS = (SOURCE.with_name("blocks.h"),)  # what kernels.c includes: hashed with it, found with -I
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# Instruction sets used where the CPU has them (its /proc/cpuinfo flag: the compiler options), each
# combination its own library, every one giving the same bits. AVX-VNNI: the int8 dot products of GGUF
# blocks in one instruction; AVX512-VNNI (every CPU with it has AVX512 F/BW/VL): two blocks' at once.
OPTIONAL_CFLAGS = {
    "avx_vnni": ("-mavxvnni",),
    "avx512_vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
}
COMPILERS = ("cc", "gcc")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay" / "ops"


def load_cpu_kernels(
    cache_dir: Path | None = None, *, source: Path = SOURCE, flags: frozenset[str] | None = None
) -> CpuKernels | None:
    """The compiled CPU kernels, or None where the CPU (`flags`, default /proc/cpuinfo) lacks AVX2/FMA;
    built with the OPTIONAL_CFLAGS the CPU has.

    Raises KernelBuildError where the CPU could run them but they cannot be built or loaded.
    """
    cpu = cpu_flags() if flags is None else flags
    if not can_run_cpu_kernels(cpu):
        log.info("cpu kernels off: the CPU lacks AVX2/FMA; using the torch path")
        return None
    compiler = next((path for name in COMPILERS if (path := shutil.which(name))), None)
    if compiler is None:
        raise KernelBuildError(f"no C compiler ({' or '.join(COMPILERS)}) on PATH to build {source}")
    for part in (source, *HEADERS):
        if not part.is_file():
            raise KernelBuildError(f"the kernel source {part} is missing: kvrelay is installed without it")
    cflags = CFLAGS + tuple(o for flag, options in OPTIONAL_CFLAGS.items() if flag in cpu for o in options)
    library = _build(compiler, cache_dir or default_cache_dir(), source, cflags)
    try:
        return CpuKernels(ctypes.CDLL(str(library)))
    except (OSError, AttributeError) as exc:
        raise KernelBuildError(f"the built kernels {library} do not load: {exc}") from exc


def build_every_variant(compiler: str, cache_dir: Path) -> list[Path]:
    """The library for every combination of OPTIONAL_CFLAGS: worker.Dockerfile builds them all at image
    build time, since the image's build host need not be the CPU it runs on."""
    options = list(OPTIONAL_CFLAGS.values())
    variants = [
        tuple(o for i, group in enumerate(options) if mask >> i & 1 for o in group)
        for mask in range(1 << len(options))
    ]
    return [_build(compiler, cache_dir, SOURCE, CFLAGS + variant) for variant in variants]


def _build(compiler: str, cache_dir: Path, source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """The cached library built from `source` with `cflags`."""
    code = source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    digest = hashlib.sha256(code + " ".join((compiler, *cflags)).encode()).hexdigest()[:16]
    target = cache_dir / f"kernels-{digest}.so"
    if target.is_file():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=cache_dir)
        os.close(fd)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel cache {cache_dir}: {exc}") from exc
    try:
        _compile([compiler, *cflags, f"-I{SOURCE.parent}", str(source), "-o", tmp, "-lm"])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built cpu kernels", extra={"path": str(target)})
    return target


def _compile(command: list[str]) -> None:
    shown = " ".join(command)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        raise KernelBuildError(f"{shown} failed (exit {exc.returncode}):\n{exc.stderr[-4000:]}") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{shown} failed: {exc}") from exc
