"""Import contracts: the engine's model code, KV cache, batching and sampling are ours; only weight and
config loading may come from transformers or gguf. Torch-free layers stay torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"

# Modules allowed to import transformers / gguf: turning a GGUF into a model directory.
LOADING_MODULES = {"services/engine/prepare.py"}
# Pure bookkeeping: no tensors, no I/O (STYLE principle 4).
PURE_ENGINE_MODULES = {
    "services/engine/request.py",
    "services/engine/block_pool.py",
    "services/engine/kv_manager.py",
    "services/engine/scheduler.py",
}
TORCH_FREE_PACKAGES = ("services/common/", "services/codec/", "services/router/")


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


def test_only_weight_loading_imports_transformers_or_gguf() -> None:
    offenders = {
        name
        for name, roots in modules().items()
        if name.startswith("services/engine/")
        and roots & {"transformers", "gguf"}
        and name not in LOADING_MODULES
    }
    assert not offenders, f"engine modules importing transformers/gguf: {sorted(offenders)}"


def test_no_service_outside_the_engine_and_cli_imports_transformers() -> None:
    offenders = {
        name
        for name, roots in modules().items()
        if "transformers" in roots and not name.startswith(("services/engine/", "services/cli/"))
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
