"""The Triton dispatch table: every specialization compiles ahead of time for the H200 (sm_90) on this
CPU-only machine with shared memory inside the limit, and every layer of the four families' real
configs maps to an entry (so none of them would quietly fall back to torch-native attention on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.errors import ModelLoadError
from services.engine.layers.attention_backend import TorchAttention, choose_attention
from services.engine.model_config import ModelConfig
from services.engine.ops.triton.aot import H200_SHARED_BYTES
from services.engine.ops.triton.dispatch import (
    BLOCK_SIZES,
    DISPATCH_TABLE,
    SpecKey,
    model_specs,
    specializations,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Shapes from the public config.json of each model (only what attention reads).
_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "intermediate_size": 64}
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "intermediate_size": 64}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "intermediate_size": 64}
_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 1000, "intermediate_size": 64}
REAL_CONFIGS = {
    "SmolLM2-135M": _LLAMA | {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                              "num_key_value_heads": 3},
    "Llama-3.2-1B": _LLAMA | {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 64},
    "Llama-3.1-8B": _LLAMA | {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8},
    "Qwen2.5-7B": _QWEN2 | {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                            "num_key_value_heads": 4, "use_sliding_window": True, "sliding_window": 4096,
                            "max_window_layers": 21},
    "Qwen3-8B": _QWEN3 | {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "head_dim": 128},
    "Gemma3-270M": _GEMMA3 | {"hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4,
                              "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
                              "sliding_window_pattern": 6},
    "Gemma3-27B": _GEMMA3 | {"hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
                             "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
                             "sliding_window_pattern": 6},
}  # fmt: skip


def test_the_table_holds_every_key_the_issue_names() -> None:
    assert len(DISPATCH_TABLE) == 3 * 3 * 8 * 2 * 2
    assert len(specializations()) == 18, "the ratio and the window are runtime arguments"
    for key, spec in DISPATCH_TABLE.items():
        assert (spec.dtype, spec.head_dim, spec.block_size) == (key.dtype, key.head_size, key.block_size)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_layer_of_the_families_maps_to_an_entry(name: str, dtype: torch.dtype) -> None:
    config = ModelConfig.from_dict(REAL_CONFIGS[name])
    for block_size in BLOCK_SIZES:
        specs = model_specs(config, dtype, block_size)
        assert specs is not None and len(specs) == config.num_layers, f"{name} would fall back"
    if name.startswith(("Gemma3", "Qwen2.5")):
        assert config.has_sliding_windows, "the windowed layers must be among those mapped"


def test_a_shape_outside_the_table_is_refused_by_triton_and_left_to_torch_by_auto() -> None:
    odd = ModelConfig.from_dict(_LLAMA | {"hidden_size": 640, "num_hidden_layers": 2,
                                          "num_attention_heads": 8, "num_key_value_heads": 8})  # fmt: skip
    assert odd.head_dim == 80
    assert model_specs(odd, torch.bfloat16, 16) is None
    with pytest.raises(ModelLoadError, match=r"no Triton kernel specialization .*head_size=80"):
        choose_attention("triton", odd, torch.bfloat16, torch.device("cpu"), 16)
    cuda = torch.device("cuda")  # auto on a GPU: the torch-native fallback, decided without touching it
    assert isinstance(choose_attention("auto", odd, torch.bfloat16, cuda, 16), TorchAttention)
    fits = ModelConfig.from_dict(REAL_CONFIGS["Llama-3.1-8B"])
    with pytest.raises(ModelLoadError, match="block_size=64"):
        choose_attention("triton", fits, torch.bfloat16, torch.device("cpu"), 64)


def test_every_specialization_compiles_for_sm90_within_shared_memory() -> None:
    """Compiled in a child without TRITON_INTERPRET (interpreted kernels cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "services.engine.ops.triton.aot"]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])["compiled"]
    kernels = {"store_kv_kernel", "paged_attention_kernel", "split_decode_kernel", "reduce_segments_kernel"}
    assert len(compiled) == len(specializations()) * len(kernels)
    for spec in specializations():
        got = {row[3] for row in compiled if row[:3] == [spec.triton_dtype, spec.head_dim, spec.block_size]}
        assert got == kernels, spec
    assert max(row[4] for row in compiled) <= H200_SHARED_BYTES
    assert max(row[4] for row in compiled if row[3] == "paged_attention_kernel") > 0, "tiles use smem"


def test_spec_keys_read_the_window_per_layer() -> None:
    gemma = ModelConfig.from_dict(REAL_CONFIGS["Gemma3-270M"])
    keys = [SpecKey(torch.bfloat16, 256, 4, gemma.window(i) is not None, 16) for i in range(18)]
    assert sum(not k.sliding for k in keys) == 3  # every sixth layer is global
    assert all(key in DISPATCH_TABLE for key in keys)
