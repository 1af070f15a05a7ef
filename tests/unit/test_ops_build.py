"""Building the C kernels: a CPU without AVX2/FMA is the only way to the torch path; every build failure
raises KernelBuildError with the compiler's output."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import KernelBuildError, ModelLoadError
from services.engine.ops import build
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
NO_AVX2 = frozenset({"sse4_2", "avx"})


@pytest.fixture
def broken_source(tmp_path: Path) -> Path:
    """A copy of kernels.c with a syntax error appended; the real file is never touched."""
    source = tmp_path / "kernels.c"
    source.write_text(build.SOURCE.read_text() + "\nint kr_broken(void) { return 1 +; }\n")
    return source


def test_a_kernels_c_that_does_not_compile_raises_with_the_compiler_output(
    broken_source: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    with pytest.raises(KernelBuildError) as caught:
        load_cpu_kernels(cache_dir, source=broken_source, flags=AVX2)
    message = str(caught.value)
    assert str(broken_source) in message  # the command that failed
    assert "kr_broken" in message and "error" in message  # the compiler's diagnostic
    assert isinstance(caught.value, ModelLoadError)  # the CLI exits 78: a restart cannot fix it
    assert not list(cache_dir.glob("*.so")), "a failed build must leave nothing in the cache"


def test_a_missing_compiler_raises_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(KernelBuildError, match="no C compiler"):
        load_cpu_kernels(tmp_path / "cache", flags=AVX2)


def test_a_missing_source_raises(tmp_path: Path) -> None:
    missing = tmp_path / "kernels.c"
    with pytest.raises(KernelBuildError, match=r"kernels\.c is missing"):
        load_cpu_kernels(tmp_path / "cache", source=missing, flags=AVX2)


def test_only_a_cpu_without_avx2_or_fma_gives_none(broken_source: Path, tmp_path: Path) -> None:
    # The hardware check comes first: no build is attempted, so even a broken source gives None.
    assert load_cpu_kernels(tmp_path / "cache", source=broken_source, flags=NO_AVX2) is None
    assert load_cpu_kernels(tmp_path / "cache", source=broken_source, flags=AVX2 - {"fma"}) is None
    assert not (tmp_path / "cache").exists()


def test_the_shipped_kernels_build_and_load_into_a_fresh_cache(tmp_path: Path) -> None:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA, which the C kernels need")
    kernels = load_cpu_kernels(tmp_path / "cache")
    assert kernels is not None
    assert len(list((tmp_path / "cache").glob("kernels-*.so"))) == 1


def test_every_variant_builds_whatever_this_cpu_is(tmp_path: Path) -> None:
    """An image's build host need not be the node's CPU, so every variant (AVX-VNNI, AVX512-VNNI, both)
    must compile anywhere."""
    libraries = build.build_every_variant(build.COMPILERS[0], tmp_path)
    assert len(libraries) == 1 << len(build.OPTIONAL_CFLAGS) and len(set(libraries)) == len(libraries)
    assert all(library.is_file() for library in libraries)
