"""The device-generic engine path (what a GPU runs: torch-native paged attention, metadata moved to the
cache's device, no C kernels, no host arena) run on the CPU with `engine.attention: torch`: greedy tokens
identical to the CPU engine's on tiny random models of each family, across a preemption and a prefix hit.
And a model handed over as a state dict in memory (loader.load_state_dict) serves the same tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.common.config import load_config
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from services.engine.loading.factory import build_core_from_loaded
from services.engine.loading.loader import load_model, load_state_dict, stored_weight_bytes
from tests.engine_helpers import make_engine, run_to_completion
from tests.tiny_model import make_tiny_gemma3, make_tiny_llama, make_tiny_qwen3

FAMILIES: dict[str, Callable[..., Path]] = {
    "llama": make_tiny_llama,
    "qwen3": make_tiny_qwen3,
    "gemma3": make_tiny_gemma3,
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PREFIX = [(7 * i + 3) % 120 + 2 for i in range(40)]


def prompts() -> dict[str, list[int]]:
    """24 prompts sharing a 40-token prefix (prefix hits once the first finishes), then a tail each."""
    return {f"p{i}": PREFIX + [(11 * i + j) % 120 + 2 for j in range(8 + 3 * i)] for i in range(24)}


def serve(engine: EngineCore) -> dict[str, list[int]]:
    """A first request alone (its prefix gets cached), then the rest together in a tight cache."""
    items = list(prompts().items())
    engine.add_request(items[0][0], items[0][1], PARAMS)
    out = run_to_completion(engine)
    for request_id, prompt in items[1:]:
        engine.add_request(request_id, prompt, PARAMS)
    return out | run_to_completion(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_torch_path_gives_the_cpu_engines_tokens(family: str, tmp_path: Path) -> None:
    model_dir = FAMILIES[family](tmp_path / family)
    # 1 MiB holds 128 to 256 blocks of 8 tokens here (1,024 to 2,048 tokens): 23 prompts of 51-117 tokens
    # (40 of them shared), each generating 64, need about 310 blocks at once: some are preempted.
    tight: dict[str, Any] = {"block_size": 8, "kv_cache_memory_mb": 1, "max_model_len": 256}
    cpu = make_engine(model_dir, "float32", **tight)
    generic = make_engine(model_dir, "float32", attention="torch", **tight)
    assert generic.device == torch.device("cpu")
    expected = serve(cpu)
    got = serve(generic)
    assert got == expected
    stats = generic.stats()
    assert stats.num_preemptions >= 1, "the cache was meant to be too small for every request at once"
    assert stats.prefix_cache_hits >= len(PREFIX) // 8 * 8, "the shared prefix was meant to be found"
    assert stats.kv_blocks.num_active == 0


def test_a_state_dict_in_memory_serves_the_directorys_tokens(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    state = load_file(str(model_dir / "model.safetensors"))
    hf_config = json.loads((model_dir / "config.json").read_text())
    loaded = load_state_dict(hf_config, state, dtype="float32", fingerprint="tiny-llama-in-memory")
    assert loaded.manifest.model_fingerprint == "tiny-llama-in-memory"
    config = load_config(None, env={})
    from_memory = build_core_from_loaded(loaded, config)
    from_disk = make_engine(model_dir, "float32")
    assert serve(from_memory) == serve(from_disk)


def test_a_state_dicts_default_fingerprint_follows_its_shapes(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    state = load_file(str(model_dir / "model.safetensors"))
    hf_config = json.loads((model_dir / "config.json").read_text())
    first = load_state_dict(hf_config, state, dtype="float32").manifest.model_fingerprint
    again = load_state_dict(hf_config, dict(state), dtype="float32").manifest.model_fingerprint
    wider = load_state_dict({**hf_config, "rope_theta": 5.0}, state, dtype="float32").manifest
    assert first == again and len(first) == 64
    assert wider.model_fingerprint != first


def test_the_weight_bytes_a_device_is_checked_for_come_from_the_headers(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    state = load_file(str(model_dir / "model.safetensors"))
    numel = sum(t.numel() for t in state.values())
    assert stored_weight_bytes(model_dir, "float32", "cpu") == numel * 4
    assert stored_weight_bytes(model_dir, "bfloat16", "cuda") == numel * 2
    assert load_model(model_dir, "float32").manifest.model_fingerprint


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_overlapped_steps_give_the_same_tokens_on_the_model_runner(family: str, tmp_path: Path) -> None:
    """`engine.overlap` on the real runner: each step's placeholders are filled from the last launch's
    picks on the device (here CPU tensors), through a preemption and a prefix hit."""
    model_dir = FAMILIES[family](tmp_path / family)
    tight: dict[str, Any] = {"block_size": 8, "kv_cache_memory_mb": 1, "max_model_len": 256}
    plain = make_engine(model_dir, "float32", attention="torch", **tight)
    overlapped = make_engine(model_dir, "float32", attention="torch", overlap=True, **tight)
    assert overlapped.overlap and not plain.overlap
    assert serve(overlapped) == serve(plain)
    assert overlapped.stats().num_preemptions >= 1
    assert overlapped.stats().kv_blocks.num_active == 0


def test_overlapped_steps_keep_seeded_draws_logprobs_and_stops(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama")
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=40, logprobs=2, stop_token_ids=tuple(range(100, 128))
    )
    results = []
    for overlap in (False, True):
        engine = make_engine(model_dir, "float32", overlap=overlap)
        for request_id, prompt in list(prompts().items())[:6]:
            engine.add_request(request_id, prompt, params)
        outputs = []
        while engine.has_work():
            outputs += [(o.request_id, o.new_token_ids, o.logprobs, o.finish_reason) for o in engine.step()]
        results.append(sorted(outputs, key=lambda o: o[0]))
    assert results[1] == results[0]
    assert any(reason is not None and reason.value == "stop" for *_, reason in results[0])
