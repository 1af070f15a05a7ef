"""`engine.attention: triton` on the CPU (the kernels under Triton's interpreter, conftest.py) gives greedy
tokens identical to the torch-native path on tiny random models of each family (GQA; Qwen3's q/k norms;
Gemma 3's windows and scale), across a prefix hit, chunked prefill over a cached prefix, mixed steps
and a preemption; with split-KV decode forced on as well. Head size 64, so the dispatch table has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from services.common.config import load_config
from services.common.errors import ConfigError
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from services.engine.loading.factory import build_core_from_loaded
from services.engine.loading.loader import load_state_dict
from services.engine.ops.triton.launch import TritonAttention
from tests.engine_helpers import make_engine, run_to_completion
from tests.tiny_model import make_tiny_gemma3, make_tiny_llama, make_tiny_qwen3

SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
FAMILIES: dict[str, tuple[Callable[..., Path], dict[str, Any]]] = {
    "llama": (make_tiny_llama, SHAPE),
    "qwen3": (make_tiny_qwen3, SHAPE),
    "gemma3": (make_tiny_gemma3, SHAPE | {"num_key_value_heads": 1}),
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PREFIX = [(7 * i + 3) % 120 + 2 for i in range(20)]
# 16-token blocks, 48 of them: the five prompts (20 shared + 5..29 own tokens, 10 generated) want 19
# blocks at once besides the prefix; 24 tokens per step cuts the longer prompts into chunks.
TIGHT: dict[str, Any] = {"block_size": 16, "max_model_len": 128, "max_num_batched_tokens": 24}


def serve(engine: EngineCore, count: int = 5, params: SamplingParams = PARAMS) -> dict[str, list[int]]:
    """One request alone (its prefix is cached), then the others at once, hitting it."""
    prompts = {f"p{i}": PREFIX + [(11 * i + j) % 120 + 2 for j in range(5 + 6 * i)] for i in range(count)}
    first = next(iter(prompts))
    engine.add_request(first, prompts.pop(first), params)
    out = run_to_completion(engine)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return out | run_to_completion(engine)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_attention_gives_the_torch_paths_tokens(family: str, tmp_path: Path) -> None:
    make, shape = FAMILIES[family]
    model_dir = make(tmp_path / family, **shape)
    want = serve(make_engine(model_dir, "float32", attention="torch", **TIGHT))
    engine = make_engine(model_dir, "float32", attention="triton", **TIGHT)
    paged = engine.runner.model.paged  # type: ignore[attr-defined]
    assert isinstance(paged, TritonAttention)
    assert serve(engine) == want
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 16, "the shared prefix was meant to be found"
    assert stats.kv_blocks.num_active == 0
    split = make_engine(model_dir, "float32", attention="triton", **TIGHT)
    split.runner.model.paged.split = True  # type: ignore[attr-defined]
    assert serve(split) == want


def test_a_preempted_request_recomputes_the_same_tokens(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", **SHAPE, num_hidden_layers=4)
    # 1 MiB holds 16 blocks of 16 tokens of this 4-layer model; seven prompts of 31 to 67 tokens, each
    # growing by 16, want more than 30 at once.
    tight = TIGHT | {"kv_cache_memory_mb": 1}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = serve(make_engine(model_dir, "float32", attention="torch", **tight), 8, params)
    engine = make_engine(model_dir, "float32", attention="triton", **tight)
    assert serve(engine, 8, params) == want
    assert engine.stats().num_preemptions >= 1, "the cache was meant to be too small for all at once"


def test_triton_on_a_cpu_without_the_interpreter_is_refused_with_the_fix(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", **SHAPE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import sys; from services.engine.loading.loader import load_model\n"
        "from services.common.errors import "
        "ModelLoadError\ntry:\n load_model(sys.argv[1], 'float32', attention='triton')\n"
        "except ModelLoadError as e:\n print(e); sys.exit(3)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "start the process with TRITON_INTERPRET=1" in done.stdout


def test_kernels_specialised_for_another_block_size_are_refused(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "llama", **SHAPE)
    state = load_file(str(model_dir / "model.safetensors"))
    hf_config = json.loads((model_dir / "config.json").read_text())
    loaded = load_state_dict(hf_config, state, dtype="float32", attention="triton", block_size=16)
    config = load_config(None, env={})
    config = config.model_copy(update={"engine": config.engine.model_copy(update={"block_size": 32})})
    with pytest.raises(
        ConfigError, match=r"specialised for KV blocks of 16 tokens, but engine\.block_size is 32"
    ):
        build_core_from_loaded(loaded, config)
