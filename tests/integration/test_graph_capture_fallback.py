"""A decode graph capture that fails on a Triton compile error (engine/loading/factory.py `_captured`).

Triton's errors are not RuntimeErrors: a kernel that does not compile for the GPU raises a
`triton.compiler.errors.CompilationError` in the capture's warm-up. With `engine.cuda_graphs` unset the
engine must log it and run eagerly; with graphs required it must not start. A kernel that does not compile
would fail the eager steps as well (its constexprs are the model's), so the fallback also leaves the Triton
kernels for torch-native attention. The error is raised where it would be on a GPU, from the split-KV
kernel's launch, which only the captured decode buckets take here (the eager steps' contexts are far below
split-KV's 32 blocks).
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from triton.compiler.errors import CompilationError

from services.common.sampling import SamplingParams
from services.engine.layers.attention_backend import PagedAttention
from services.engine.loading import factory
from services.engine.ops.triton import kernels
from services.engine.runner import ModelRunner
from tests.engine_helpers import generate, make_engine
from tests.tiny_model import make_tiny_llama

SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
ENGINE: dict[str, Any] = {"attention": "triton", "block_size": 16, "max_model_len": 128}
PROMPTS = {"a": [5, 9, 13, 2], "b": [7, 3, 11, 4, 6, 8, 10]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class _DoesNotCompile:
    """A kernel whose every launch fails as Triton's compiler does on a construct the GPU lacks."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            raise CompilationError(None, ast.Pass(), "tl.dot: unsupported on this target")

        return launch


def _graphs_on_as_on_a_gpu(setting: bool | None, paged: PagedAttention, device: torch.device) -> bool:
    """factory._graphs_on's rule on a GPU, where an unset `engine.cuda_graphs` means on."""
    return paged.graph_safe if setting is None else setting


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("fallback") / "llama", **SHAPE)


@pytest.fixture
def split_kv_does_not_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not issubclass(CompilationError, RuntimeError), "the case this file is about"
    monkeypatch.setattr(kernels, "split_decode_kernel", _DoesNotCompile())


def test_a_compile_error_at_capture_falls_back_to_eager_when_graphs_were_not_asked_for(
    model_dir: Path,
    split_kv_does_not_compile: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    eager = generate(make_engine(model_dir, batch_size_limit=8, cuda_graphs=False, **ENGINE), PROMPTS, PARAMS)
    monkeypatch.setattr(factory, "_graphs_on", _graphs_on_as_on_a_gpu)
    with caplog.at_level(logging.WARNING, logger=factory.__name__):
        engine = make_engine(model_dir, batch_size_limit=8, **ENGINE)  # engine.cuda_graphs unset
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is None
    message = "a Triton kernel failed at decode graph capture; torch-native attention, eagerly"
    [record] = [r for r in caplog.records if r.getMessage() == message]
    assert record.reason.startswith("CompilationError:")  # type: ignore[attr-defined]
    assert runner.model.paged.name == "torch"  # eager steps past split-KV's threshold would meet the kernel
    assert generate(engine, PROMPTS, PARAMS) == eager


def test_a_compile_error_at_capture_stops_an_engine_that_requires_graphs(
    model_dir: Path, split_kv_does_not_compile: None
) -> None:
    with pytest.raises(CompilationError, match="unsupported on this target"):
        make_engine(model_dir, batch_size_limit=8, cuda_graphs=True, **ENGINE)
