"""The `kvrelay bench` stub (services/cli/bench.py): it checks the same packages the `bench` extra
installs, builds the kvrelay parser without loading services.bench, hands every argument (--help too)
to services.bench, and without the extra prints one line saying how to install it and exits 2 (without
services/bench itself, as in the images, one line saying so)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from services.cli import bench as stub
from services.cli.main import main
from tests.conftest import REPO_ROOT

# Runs `kvrelay <argv>` with the named modules (and their submodules) made unimportable, then reports
# whether services.bench was loaded.
BLOCKED_RUN = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(",")) - {""}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Blocker())
from services.cli.main import build_parser, main
code = 0
try:
    if sys.argv[2] == "parser-only":
        build_parser()
    else:
        code = main(sys.argv[2:])
finally:  # --help exits through SystemExit
    print("services.bench loaded:", any(m.split(".")[:2] == ["services", "bench"] for m in sys.modules))
sys.exit(code)
"""


BENCHMARKS = [
    "engine",
    "agreement",
    "stack",
    "serve",
    "compare",
    "peers",
    "routing",
    "transfer",
    "admission",
    "grammar",
]


def run_blocked(blocked: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, ",".join(blocked), *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_stub_checks_exactly_the_packages_of_the_bench_extra() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extra = {Requirement(r).name.lower() for r in project["optional-dependencies"]["bench"]}
    assert extra == set(stub.BENCH_EXTRA_MODULES)  # each of these imports under its distribution name


def test_building_the_kvrelay_parser_does_not_load_the_bench() -> None:
    done = run_blocked([], "parser-only")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "services.bench loaded: False" in done.stdout


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "engine", "--help"], ["bench", "serve"]])
def test_without_the_bench_extra_kvrelay_bench_says_how_to_install_it_in_one_line(argv: list[str]) -> None:
    done = run_blocked(["httpx", "matplotlib"], *argv)
    assert done.returncode == stub.MISSING_EXTRA_EXIT_CODE == 2
    [line] = done.stderr.splitlines()
    assert line == f"{stub.MISSING_EXTRA} (missing: httpx, matplotlib)"
    assert "pip install 'kvrelay[bench]'" in line
    assert done.stdout.splitlines() == ["services.bench loaded: False"]


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "engine", "--help"]])
def test_without_services_bench_kvrelay_bench_says_it_is_not_installed(argv: list[str]) -> None:
    done = run_blocked([stub.BENCH_PACKAGE], *argv)
    assert done.returncode == stub.MISSING_EXTRA_EXIT_CODE
    assert done.stderr.splitlines() == [stub.MISSING_PACKAGE]
    assert done.stdout.splitlines() == ["services.bench loaded: False"]


def test_other_commands_run_without_the_bench_extra() -> None:
    done = run_blocked(list(stub.BENCH_EXTRA_MODULES), "config", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: kvrelay config" in done.stdout
    assert "services.bench loaded: False" in done.stdout


def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvrelay bench")
    for name in BENCHMARKS:
        assert name in out


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_has_its_own_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvrelay bench {name}")


def test_a_bad_bench_flag_is_refused_by_the_bench_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_a_negative_depth_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--depth", "-5"])
    assert exit_info.value.code == 2
    assert "--depth: must be 0 or more, got -5" in capsys.readouterr().err
