"""The engine's seams, as tests: the async client uses only the core's public methods, and the core is
built from parts handed to it (a fake runner stands in for the model)."""

from __future__ import annotations

import ast
from pathlib import Path

from services.engine.core import EngineCore
from services.engine.runner import ModelRunner
from services.engine.runner_protocol import Runner
from tests.engine_fakes import FakeRunner

ENGINE = Path(__file__).resolve().parents[2] / "services" / "engine"


def core_public_api() -> set[str]:
    """What EngineCore's class defines for callers: its methods and properties, not its parts."""
    return {name for name in vars(EngineCore) if not name.startswith("_")}


def attributes_used_on_the_core(path: Path) -> set[str]:
    """Every `core.X` and `self.core.X` in a module."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "core") or (
            isinstance(owner, ast.Attribute) and owner.attr == "core"
        ):
            used.add(node.attr)
    return used


def test_the_async_engine_uses_only_the_cores_public_methods() -> None:
    used = attributes_used_on_the_core(ENGINE / "async_engine.py")
    assert used, "the check found no use of the core at all"
    assert used <= core_public_api(), f"AsyncEngine reaches into the core: {sorted(used - core_public_api())}"
    assert not used & {"pool", "scheduler", "runner", "kv", "prefix_stats"}


def test_the_core_parts_are_not_class_level_api() -> None:
    """The check above relies on the parts being instance attributes, which vars(EngineCore) omits."""
    assert not core_public_api() & {"pool", "scheduler", "runner", "kv"}


def test_both_runners_satisfy_the_runner_protocol() -> None:
    protocol = {
        name for name in vars(Runner) if not name.startswith("_") and name not in {"register", "copy_with"}
    }
    assert protocol >= {"execute", "read_kv", "write_kv", "set_before_forward", "weight_dtype", "kv_dtype"}
    for runner in (ModelRunner, FakeRunner):
        assert protocol <= set(dir(runner)), f"{runner.__name__} lacks {sorted(protocol - set(dir(runner)))}"
