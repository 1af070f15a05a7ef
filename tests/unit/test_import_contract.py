"""The house's import rules. Most are import-linter contracts (pyproject.toml, `[tool.importlinter]`), run
here with `lint-imports`: the engine's floors (loading and the async client over the core, over the runner,
over the model families, over the layers, over the ops, over the pure scheduling wing and the model
config), the torch-free packages, the modules that may import transformers or gguf, the engine as a library
that imports no service, KV transfer apart from the engine, the benchmarks behind the CLI stub, the pools
apart from each other, and the codec's rooms. What a contract cannot say is checked below: no file circle
anywhere in services/, at most ten modules at the engine's top, and the CLI stub importing the bench only
inside the function that runs the command."""

from __future__ import annotations

import ast
import graphlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
ROOT = SERVICES.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
BENCH_PACKAGE = "services.bench"
# The one module outside services/bench that may import it, inside the function that runs the command.
BENCH_STUB = "services/cli/bench.py"
MAX_ENGINE_TOP_MODULES = 10


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the `services` package under `root`, with the contracts of root/pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}  # one line per contract
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_import_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("engine/scheduling/scheduler.py", "import torch", "Torch-free"),
        ("engine/layers/rope.py", "from services.engine.models import llama", "The engine's floors"),
        ("engine/core.py", "from services.engine.loading import factory", "The engine's floors"),
        ("codec/text/tokenizer.py", "import grpc", "codec text/"),
        (
            "prefill/prefill_service.py",
            "from services.decode import remote_prefill",
            "The prefill and decode pools",
        ),
    ],
)
def test_a_broken_rule_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """The contracts are live: one forbidden import, in a copy of the tree, breaks the named contract."""
    shutil.copytree(SERVICES, tmp_path / "services", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "services" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    verdicts = [row for row in result.stdout.splitlines() if row.startswith(contract)]
    assert verdicts, result.stdout
    assert all(row.endswith("BROKEN") for row in verdicts[:1]), result.stdout
    assert sum(row.endswith("BROKEN") for row in result.stdout.splitlines()) == 1  # that contract alone
    assert lint_imports(ROOT).returncode == 0  # the real tree is untouched


def test_no_file_circle_in_services() -> None:
    """No module reaches itself through the modules it imports, counting imports inside functions."""
    graph = grimp.build_graph("services", exclude_type_checking_imports=True, cache_dir=None)
    modules = {m for m in graph.modules if not m.startswith("services.proto_gen")}
    assert len(modules) > 150
    imports = {m: graph.find_modules_directly_imported_by(m) & modules - {m} for m in modules}
    try:
        graphlib.TopologicalSorter(imports).prepare()
    except graphlib.CycleError as circle:
        pytest.fail(f"a file circle in services/: {' -> '.join(circle.args[1])}")


def test_at_most_ten_modules_sit_at_the_engines_top() -> None:
    top = sorted(p.name for p in (SERVICES / "engine").glob("*.py"))
    assert len(top) <= MAX_ENGINE_TOP_MODULES, top
    wings = {p.name for p in (SERVICES / "engine").iterdir() if (p / "__init__.py").exists()}
    assert wings == {"scheduling", "layers", "loading", "models", "ops"}


def bench_imports(tree: ast.AST) -> list[ast.stmt]:
    """The import statements under `tree` that load services.bench or a module of it."""
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(n == BENCH_PACKAGE or n.startswith(f"{BENCH_PACKAGE}.") for n in names):
            found.append(node)
    return found


def test_the_cli_stub_imports_the_bench_only_inside_a_function() -> None:
    tree = ast.parse((SERVICES.parent / BENCH_STUB).read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    in_functions = {id(node) for f in functions for node in bench_imports(f)}
    everywhere = bench_imports(tree)
    assert everywhere, f"{BENCH_STUB} no longer hands the command to {BENCH_PACKAGE}"
    at_top_level = [f"line {n.lineno}" for n in everywhere if id(n) not in in_functions]
    assert not at_top_level, f"{BENCH_STUB} imports {BENCH_PACKAGE} at module level: {at_top_level}"


def test_the_worker_serves_every_role_from_one_package() -> None:
    worker = {p.name for p in (SERVICES / "worker").glob("*.py")}
    assert {"server.py", "worker_service.py", "counters.py", "metrics.py", "outputs.py"} <= worker
    assert not (SERVICES / "decode" / "server.py").exists()
    assert "services.worker.server" in (SERVICES / "cli" / "worker.py").read_text()
