"""Triton compiles one variant of a kernel per specialization key of its launch arguments (an int's value
1 or divisibility by 16, a pointer's 16-byte alignment). A key that changes from step to step is a compile
in the middle of serving, hundreds of milliseconds on a GPU. Under the interpreter nothing compiles, so
these tests compute the key Triton's launcher would (its binder, for sm_90) for every launch of steps
whose block tables are 1, 3, 16, 17 and 32 blocks wide, and require one key per kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from services.engine.ops.triton import kernels
from tests.unit.test_triton_kernels import Step

KERNELS = ("store_kv_kernel", "paged_attention_kernel", "split_decode_kernel", "reduce_segments_kernel")


class LaunchSpy:
    """Stands in for a kernel of `kernels`: records each launch's arguments, then launches it or not."""

    def __init__(self, kernel: Any, *, launch: bool) -> None:
        self.kernel = kernel
        self.launch = launch
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((args, kwargs))
            if self.launch:
                self.kernel[grid](*args, **kwargs)

        return launch


def specialization_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The key `JITFunction.run` looks its compiled variants up by, for an sm_90 launch (options aside)."""
    if not isinstance(kernel, JITFunction):  # interpreted: the decorator's settings are kept in `kwargs`
        settings = {k: v for k, v in kernel.kwargs.items() if k.startswith("do_not_specialize")}
        kernel = JITFunction(kernel.fn, **settings)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, specialization, _ = binder(*args, **kwargs)
    return tuple(specialization)


def test_one_variant_per_kernel_whatever_the_table_width_row_count_and_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spies = {name: LaunchSpy(getattr(kernels, name), launch=False) for name in KERNELS}
    for name, spy in spies.items():
        monkeypatch.setattr(kernels, name, spy)
    for width in (1, 3, 16, 17, 32):  # blocks in the step's longest row: the block table's row stride
        ctx = 16 * width
        # decode rows; a fresh prompt; a chunk over a cached prefix: the paged kernel takes two runs of rows
        rows = [(ctx, 1)] if width == 1 else [(ctx, 1), (3, 1), (9, 9), (ctx - 1, 5)]
        for split in (False, True):
            step = Step(rows, split=split)
            assert step.meta.block_tables.stride(0) == width
            step.run(window=None if split else 16)
    for name, spy in spies.items():
        keys = {specialization_key(spy.kernel, args, kwargs) for args, kwargs in spy.calls}
        assert len(spy.calls) >= 5, name
        assert len(keys) == 1, f"{name}: {len(keys)} variants over {len(spy.calls)} launches"
