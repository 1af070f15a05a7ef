"""A guard that fails on anything in an engine step that would make the host wait for a CUDA stream.

On a GPU these block the host until the stream has drained, so an overlapped step (core.py) turns serial:
reading a device tensor's values (`item`, `bool`, `int`, `tolist`, `numpy`, `nonzero`, `equal`), building a
tensor from host lists on the compute device (`torch.tensor(values, device=...)`: a pageable copy that
waits), and a copy to or from the device without `non_blocking`. The tests run on a CPU, where host and device
are one, so the guard tells them apart by where a tensor came from:

- host-born: built from host values (`torch.tensor` / factories with no `device`), and whatever is
  computed from host-born tensors alone;
- device-born: everything else (weights, the KV cache, logits, and what `to_device` hands the step: the
  guard wraps it so its result counts as a copy on the device, as it is on a GPU).

Reading a host-born tensor is free on a GPU too (the metadata built on the host); reading a device-born one
is a stream sync. `HostSyncGuard.violations` lists each with the op and the caller.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,  # item(), bool(), int(), float()
    torch.ops.aten.nonzero.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}
FACTORIES = ("tensor", "as_tensor", "asarray", "arange", "zeros", "ones", "empty", "full", "randn", "rand")


class HostSyncGuard(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._host_ids: set[int] = set()  # ids of live host-born tensors (a WeakSet compares with ==)
        self.violations: list[str] = []

    def is_host(self, t: torch.Tensor) -> bool:
        return id(t) in self._host_ids

    def mark_host(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and id(out) not in self._host_ids:
            self._host_ids.add(id(out))
            weakref.finalize(out, self._host_ids.discard, id(out))
        return out

    def mark_device(self, t: torch.Tensor) -> None:
        self._host_ids.discard(id(t))

    def flag(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "services" in f.filename]
        where = f"{frames[-1].filename.split('services/')[-1]}:{frames[-1].lineno}" if frames else "?"
        self.violations.append(f"{what} at {where}")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        is_host = bool(inputs) and all(self.is_host(t) for t in inputs)
        if func in SYNC_OPS and not is_host:
            self.flag(str(func))
        if func is torch.ops.aten._to_copy.default or func is torch.ops.aten.copy_.default:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != "cpu" and not kwargs.get("non_blocking"):
                self.flag(f"a blocking copy to {target}")
        out = func(*args, **kwargs)
        if is_host:
            for t in tree_flatten(out)[0]:
                self.mark_host(t)
        return out


@contextmanager
def guarding(monkeypatch: pytest.MonkeyPatch, to_device_modules: list[Any]) -> Iterator[HostSyncGuard]:
    """Patch torch's factories, the Tensor readers and each module's `to_device`, then yield an inactive
    guard: enter it (`with guard:`) around the code under watch."""
    guard = HostSyncGuard()
    active: list[bool] = [False]

    def factory(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if not active[0]:
                return out
            device = kwargs.get("device")
            if device is not None and name in ("tensor", "as_tensor", "asarray"):
                guard.flag(f"torch.{name}(host values, device={device})")
            elif device is None:
                guard.mark_host(out)
            return out

        return wrapped

    for name in FACTORIES:
        monkeypatch.setattr(torch, name, factory(name, getattr(torch, name)))

    def reader(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if active[0] and not guard.is_host(self):
                guard.flag(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return wrapped

    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, reader(name, getattr(torch.Tensor, name)))

    def to_host(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """`.cpu()` and `.to("cpu")` of a device-born tensor without non_blocking: a copy the host waits for
        (a no-op on a CPU, so it is caught here, above the dispatcher)."""

        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else kwargs.get("device")
            to_cpu = name == "cpu" or (isinstance(target, str | torch.device) and str(target) == "cpu")
            if active[0] and to_cpu and not kwargs.get("non_blocking") and not guard.is_host(self):
                guard.flag(f"Tensor.{name} to the host, blocking")
            return original(self, *args, **kwargs)

        return wrapped

    for name in ("cpu", "to"):
        monkeypatch.setattr(torch.Tensor, name, to_host(name, getattr(torch.Tensor, name)))

    for module in to_device_modules:
        original_to_device = module.to_device

        def to_device(*args: Any, _original: Callable[..., Any] = original_to_device, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            if active[0]:
                out = out.clone()  # a fresh tensor, device-born: on a GPU the step's input lives there
                guard.mark_device(out)
            return out

        monkeypatch.setattr(module, "to_device", to_device)

    class _Activation:
        def __enter__(self) -> HostSyncGuard:
            active[0] = True
            guard.__enter__()
            return guard

        def __exit__(self, *exc: object) -> None:
            guard.__exit__(*exc)
            active[0] = False

    guard.activation = _Activation()  # type: ignore[attr-defined]
    yield guard
