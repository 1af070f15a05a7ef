"""Put on PYTHONPATH by tests/integration/test_gpu_check_dry.py: every top-level module named in
KVRELAY_BLOCKED_MODULES (comma-separated) fails to import in this interpreter and in every child that
inherits the environment, as on a machine that lacks its package."""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from types import ModuleType


class _Blocker(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: not on the GPU machine)")
        return None


_names = {n for n in os.environ.get("KVRELAY_BLOCKED_MODULES", "").split(",") if n}
if _names:
    sys.meta_path.insert(0, _Blocker(_names))
