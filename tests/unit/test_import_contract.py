"""Import contracts: the engine's model code, KV cache, batching and sampling are ours; only weight and
config loading may come from transformers or gguf. Torch-free layers stay torch-free. The benchmarks
(services/bench/, the `bench` extra) are reached only through the `kvrelay bench` stub, and only once the
command runs."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.source_imports import imported_modules

SERVICES = Path(__file__).resolve().parents[2] / "services"

# Modules allowed to import transformers / gguf: turning a GGUF into a model directory.
LOADING_MODULES = {"services/engine/prepare.py", "services/engine/gguf_weights.py"}
# Pure bookkeeping: no tensors, no I/O (STYLE principle 4).
PURE_ENGINE_MODULES = {
    "services/engine/request.py",
    "services/engine/block_pool.py",
    "services/engine/kv_manager.py",
    "services/engine/scheduler.py",
}
TORCH_FREE_PACKAGES = ("services/common/", "services/codec/", "services/router/")
BENCH_PACKAGE = "services.bench"
# The one module outside services/bench that may import it, inside the function that runs the command.
BENCH_STUB = "services/cli/bench.py"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def modules() -> dict[str, set[str]]:
    root = SERVICES.parent
    return {str(p.relative_to(root)): imported_roots(p) for p in SERVICES.rglob("*.py")}


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


def test_only_weight_loading_imports_transformers_or_gguf() -> None:
    offenders = {
        name
        for name, roots in modules().items()
        if name.startswith("services/engine/")
        and roots & {"transformers", "gguf"}
        and name not in LOADING_MODULES
    }
    assert not offenders, f"engine modules importing transformers/gguf: {sorted(offenders)}"


def test_no_service_outside_the_engine_and_the_bench_imports_transformers() -> None:
    offenders = {
        name
        for name, roots in modules().items()
        if "transformers" in roots and not name.startswith(("services/engine/", "services/bench/"))
    }
    assert not offenders


def test_torch_free_layers_do_not_import_torch() -> None:
    offenders = {
        name
        for name, roots in modules().items()
        if "torch" in roots and (name.startswith(TORCH_FREE_PACKAGES) or name in PURE_ENGINE_MODULES)
    }
    assert not offenders, f"torch imported by torch-free modules: {sorted(offenders)}"


def test_the_contract_sees_the_engine_modules() -> None:
    names = set(modules())
    assert names >= PURE_ENGINE_MODULES
    assert "services/engine/models/llama.py" in names


SERVICE_PACKAGES = ("codec", "router", "worker", "prefill", "decode", "kvtransfer", "cli", "bench")


def test_the_engine_imports_no_service() -> None:
    offenders = {
        f"{path.relative_to(SERVICES.parent)}: {module}"
        for path in (SERVICES / "engine").rglob("*.py")
        for module in imported_modules(path)
        if module.split(".")[:2] in [["services", package] for package in SERVICE_PACKAGES]
    }
    assert not offenders, f"engine modules importing a service: {sorted(offenders)}"


def test_kvtransfer_imports_no_engine_core() -> None:
    """KV transfer carries KV (services/engine/kv_export.py), not the engine."""
    paths = sorted((SERVICES / "kvtransfer").rglob("*.py"))
    assert paths
    offenders = {
        f"{path.name}: {module}"
        for path in paths
        for module in imported_modules(path)
        if module.startswith("services.engine") and not module.startswith("services.engine.kv_export")
    }
    assert not offenders, f"kvtransfer importing the engine: {sorted(offenders)}"


def test_nothing_outside_the_bench_imports_it_but_the_cli_stub() -> None:
    root = SERVICES.parent
    sources = [*SERVICES.rglob("*.py"), *(root / "scripts").rglob("*.py")]
    importers = {
        str(p.relative_to(root))
        for p in sources
        if not p.is_relative_to(SERVICES / "bench") and bench_imports(ast.parse(p.read_text()))
    }
    assert importers == {BENCH_STUB}, f"modules importing {BENCH_PACKAGE}: {sorted(importers)}"


def test_the_cli_stub_imports_the_bench_only_inside_a_function() -> None:
    tree = ast.parse((SERVICES.parent / BENCH_STUB).read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    in_functions = {id(node) for f in functions for node in bench_imports(f)}
    everywhere = bench_imports(tree)
    assert everywhere, f"{BENCH_STUB} no longer hands the command to {BENCH_PACKAGE}"
    at_top_level = [f"line {n.lineno}" for n in everywhere if id(n) not in in_functions]
    assert not at_top_level, f"{BENCH_STUB} imports {BENCH_PACKAGE} at module level: {at_top_level}"


# What the worker package's shared modules are: the prefill and decode pools may use these, never the
# server or the Worker service that assemble the pools.
WORKER_LEAVES = ("services.worker.counters", "services.worker.outputs", "services.worker.request_trace")


def test_the_prefill_and_decode_pools_do_not_import_each_other() -> None:
    pools = {"prefill": SERVICES / "prefill", "decode": SERVICES / "decode"}
    offenders = set()
    for name, folder in pools.items():
        other = "decode" if name == "prefill" else "prefill"
        paths = sorted(folder.rglob("*.py"))
        assert any(p.name != "__init__.py" for p in paths), f"services/{name} holds no module"
        for path in paths:
            for module in imported_modules(path):
                if module.startswith(f"services.{other}"):
                    offenders.add(f"{name}/{path.name}: {module}")
                if module.startswith("services.worker") and not module.startswith(WORKER_LEAVES):
                    offenders.add(f"{name}/{path.name}: {module} (the worker assembles the pools)")
    assert not offenders, (
        f"pool modules importing the other pool or the worker's assembly: {sorted(offenders)}"
    )


def test_the_worker_serves_every_role_from_one_package() -> None:
    worker = {p.name for p in (SERVICES / "worker").glob("*.py")}
    assert {"server.py", "worker_service.py", "counters.py", "metrics.py", "outputs.py"} <= worker
    assert not (SERVICES / "decode" / "server.py").exists()
    assert "services.worker.server" in (SERVICES / "cli" / "worker.py").read_text()
