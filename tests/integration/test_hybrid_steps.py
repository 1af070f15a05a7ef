"""`model.weights: gguf-hybrid` on the real SmolLM2 directory: each step runs the path its size calls for,
counted per path. With the threshold at T, batch-1 decode steps run the C kernels over the GGUF blocks,
while a 512-token prefill chunk and a decode step of more than T sequences run the GEMM over the copy
unpacked at load, and no step unpacks a matrix. `auto` serves it here and falls back to gguf-int8 where
host memory would not hold the copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.loading import loader
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from tests.engine_helpers import count_unpacking, drain, make_engine

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not can_run_cpu_kernels(cpu_flags()), reason="the CPU lacks AVX2/FMA/F16C"),
]

T = 4  # engine.small_step_max_tokens in these tests


def test_each_step_runs_the_path_its_size_calls_for(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(
        model_dir, "auto", weights="gguf-hybrid", small_step_max_tokens=T, max_num_batched_tokens=512
    )
    assert engine.served.weights == "gguf-hybrid"
    assert (engine.served.small_step_max_tokens, engine.served.small_step_source) == (
        T,
        "engine.small_step_max_tokens",
    )
    assert engine.kv_dtype == torch.float16  # the decode kernels read an fp16 cache fastest
    unpacked = count_unpacking(monkeypatch)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    engine.add_request("long", list(range(1000, 1512)), greedy)  # one 512-token chunk, then 2 decode steps
    engine.step()
    assert engine.stats().steps_by_path == {"kernels": 0, "gemm": 1}
    drain(engine)
    assert engine.stats().steps_by_path == {"kernels": 2, "gemm": 1}  # batch-1 decode: the blocks

    for i in range(2 * T):  # 2T short prompts in one prefill step, then decode steps of 2T rows
        engine.add_request(f"wide-{i}", [2000 + i, 7, 8], greedy)
    drain(engine)
    assert engine.stats().steps_by_path == {"kernels": 2, "gemm": 4}
    assert unpacked["calls"] == 0  # every large step read the copy made at load


def test_auto_serves_the_hybrid_and_falls_back_to_the_blocks_alone_without_room(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hybrid = loader.load_model(model_dir, "auto", weights="auto", kv_cache_bytes=64 * 2**20)
    assert hybrid.weights == "gguf-hybrid"
    assert hybrid.step_threshold is not None and hybrid.step_threshold.source.startswith("table: ")
    monkeypatch.setattr(loader, "fits_host_memory", lambda num_bytes: False)
    blocks = loader.load_model(model_dir, "auto", weights="auto", kv_cache_bytes=64 * 2**20)
    assert blocks.weights == "gguf-int8"
    assert blocks.weight_bytes < hybrid.weight_bytes / 2  # no unpacked copy
    assert blocks.manifest.model_fingerprint != hybrid.manifest.model_fingerprint


def test_a_mode_the_cpu_cannot_run_is_refused_naming_the_setting(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    with pytest.raises(loader.ConfigError, match=r"model\.weights gguf-hybrid needs the CPU kernels"):
        loader.load_model(model_dir, "auto", weights="gguf-hybrid")
