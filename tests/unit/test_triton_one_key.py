"""A mask that is off by one key at a 4096-key context: gpu_check's kernel stage must see it.

Dropping or adding one key of 4096 moves the output by about 1/4096 of a value, far under the bf16 check's
2e-2 absolute tolerance. `self_check.one_key_ratio` measures an fp32 run's error in units of what one key
does to each row, so such an error reads ~1 or more and exact masks ~1e-4. Each case plants one wrong
comparison in a copy of kernels.py (written out and imported as its own module, under the interpreter),
runs it through the backend at 4096 keys, and holds the real kernels under ONE_KEY_LIMIT and the copy
above it. Cheap under the interpreter (under a second a run): one KV head, 8 query heads sharing it, one
decode row over blocks of 32, through split-KV (what every decode graph bucket of few rows takes) and
through the paged kernel. The window case's window (1000) puts its edge inside a block: at an edge on a
block boundary the kernel does not even visit the key a wrong comparison would admit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from services.engine.layers.triton_self_check import ONE_KEY_LIMIT, one_key_ratio
from services.engine.ops.triton import kernels, launch
from tests.unit.test_triton_kernels import Step, max_error

CONTEXT = 4096
CAUSAL = "(key_pos[None, :] <= q_pos[:, None])"
WINDOW = "(key_pos[None, :] > q_pos[:, None] - window)"
MUTANTS = {  # name: (the comparison in kernels.py, its off-by-one-key twin, the window the case runs)
    "causal_drops_its_own_key": (CAUSAL, "(key_pos[None, :] < q_pos[:, None])", None),
    "window_admits_one_key_more": (WINDOW, "(key_pos[None, :] >= q_pos[:, None] - window)", 1000),
}


def _step(dtype: torch.dtype = torch.float32, split: bool | None = None) -> Step:
    """One decode row over CONTEXT keys: split-KV (the backend's choice for it) or the paged kernel."""
    step = Step([(CONTEXT, 1)], dtype=dtype, kv_heads=1, ratio=8, block_size=32, split=split)
    assert step.attention._layout(step.meta).split_decode is (split is None)
    return step


def _ratio(step: Step, window: int | None) -> float:
    rows = [*step.decode, *step.prefill]
    return one_key_ratio(step.run(window=window), step.q, step.cache, rows, step.block_size, window=window)


def _mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """kernels.py with one comparison replaced, imported as a module of its own and put in the backend's
    place (launch.py launches `kernels.<name>` at call time)."""
    old, new, _ = MUTANTS[name]
    source = Path(kernels.__file__).read_text()
    assert source.count(old) == 1, f"kernels.py no longer has exactly one {old}"
    path = tmp_path / f"kernels_{name}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"kernels_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # Triton reads the kernels' source through it
    spec.loader.exec_module(module)
    monkeypatch.setattr(launch, "kernels", module)
    return module


@pytest.mark.parametrize("split", [None, False])
@pytest.mark.parametrize("window", [None, 1000])
def test_exact_masks_stay_far_under_the_one_key_limit_at_4k(window: int | None, split: bool | None) -> None:
    assert _ratio(_step(split=split), window) <= ONE_KEY_LIMIT / 100


@pytest.mark.parametrize("split", [None, False])
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_mask_off_by_one_key_at_4k_exceeds_the_one_key_limit(
    name: str, split: bool | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = MUTANTS[name][2]
    _mutant(tmp_path, monkeypatch, name)
    assert _ratio(_step(split=split), window) > 10 * ONE_KEY_LIMIT


def test_the_absolute_bf16_tolerance_misses_a_dropped_key_at_4k(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why stage 6 has the one-key ratio: the 2e-2 it had passes the copy that drops each query's own key."""
    _mutant(tmp_path, monkeypatch, "causal_drops_its_own_key")
    step = _step(torch.bfloat16)
    assert max_error(step.run(), step.reference()) <= 2e-2
