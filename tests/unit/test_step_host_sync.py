"""An overlapped step launches without waiting on the device: from `launch` until the step's sampled tokens
are read back in `collect`, nothing reads a device tensor, builds one from host lists on the device, or
copies to it blocking (tests/host_sync_guard.py says how a CPU run tells host from device). The engine runs
as a GPU runs it: overlapped steps, torch-native attention (no CPU kernels), the GPU's top-p branch (a
full sort; the CPU's candidate search reads a mask back), and every sampling feature of SamplingBatch."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine import runner
from services.engine.layers import attention_metadata, grammar_mask, sampler, sampling_batch
from tests.engine_helpers import make_engine, run_to_completion
from tests.host_sync_guard import guarding
from tests.tiny_model import make_tiny_llama

REQUESTS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
    "seeded-top-k": SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=6),
    "nucleus": SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, max_tokens=6, min_tokens=3),
    "penalties": SamplingParams(
        temperature=0.7, seed=3, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
        max_tokens=6, stop_token_ids=[9],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def run_guarded(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], int]:
    core = make_engine(model_dir, attention="torch", overlap=True)
    monkeypatch.setattr(sampler, "_mask_top_p_", functools.partial(sampler._mask_top_p_, full_sort=True))
    launches = 0
    with guarding(monkeypatch, [attention_metadata, runner, sampling_batch, grammar_mask]) as guard:
        launch = core.runner.launch

        def guarded_launch(step: Any) -> Any:
            nonlocal launches
            launches += 1
            with guard.activation:  # type: ignore[attr-defined]
                return launch(step)

        monkeypatch.setattr(core.runner, "launch", guarded_launch)
        for request_id, params in REQUESTS.items():
            core.add_request(request_id, [3, 4, 5, 6, 7, 8][: 3 + len(request_id) % 3], params)
        outputs = run_to_completion(core)
    assert all(len(tokens) >= 3 for tokens in outputs.values()), outputs
    return guard.violations, launches


def test_an_overlapped_step_launches_without_a_host_wait(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    violations, launches = run_guarded(model_dir, monkeypatch)
    assert launches >= 6
    assert not violations, violations


def test_the_guard_catches_a_tensor_built_from_host_lists_on_the_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def blocking_int64s(values: list[int], device: torch.device | str) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)  # the old way

    monkeypatch.setattr(sampling_batch, "_int64s", blocking_int64s)
    violations, _ = run_guarded(model_dir, monkeypatch)
    assert any("torch.tensor(host values, device=" in v and "sampling_batch" in v for v in violations)


def test_the_guard_catches_reading_a_device_tensor(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = sampler.sample_on_device

    def reads_back(logits: torch.Tensor, *args: Any) -> Any:
        logits.argmax().item()  # a value read mid-step
        logits.nonzero()
        return original(logits, *args)

    monkeypatch.setattr(runner, "sample_on_device", reads_back)
    violations, _ = run_guarded(model_dir, monkeypatch)
    assert any("_local_scalar_dense" in v for v in violations), violations
    assert any("nonzero" in v for v in violations), violations


def test_the_guard_catches_a_blocking_copy_to_the_host(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = sampler.sample_on_device

    def copies_back(logits: torch.Tensor, *args: Any) -> Any:
        logits.cpu()  # waits for the forward on a GPU
        return original(logits, *args)

    monkeypatch.setattr(runner, "sample_on_device", copies_back)
    violations, _ = run_guarded(model_dir, monkeypatch)
    assert any("Tensor.cpu to the host, blocking" in v for v in violations), violations
