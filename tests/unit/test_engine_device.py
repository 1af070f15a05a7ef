"""engine.device and GPU memory planning, from given figures: what fits, and the refusals with numbers."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.common.config import EngineConfig
from services.common.errors import CapacityError, ConfigError
from services.engine.cuda_graphs import estimate_graph_bytes
from services.engine.loading.device import (
    GIB,
    MIB,
    DeviceMemory,
    DeviceUnavailableError,
    check_shared_device,
    check_weights_fit,
    cuda_compute_dtype,
    default_batch_size_limit,
    default_batched_tokens,
    plan_device_blocks,
    resolve_device,
)
from services.engine.model_config import ModelConfig

# Llama-3.1-8B's KV: 32 layers x 2 x 8 heads x 128 x 2 bytes = 128 KiB a token, 2 MiB a 16-token block.
BLOCK_BYTES_8B = 32 * 2 * 8 * 128 * 2 * 16
H200 = 141 * GIB
LLAMA_8B = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=False,
)  # fmt: skip


def test_auto_is_the_cpu_where_no_cuda_device_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match=r"engine.device=cuda:1, but no CUDA device is visible"):
        resolve_device("cuda:1")


def test_a_cuda_index_beyond_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceUnavailableError, match=r"sees 2 CUDA device\(s\) \(0..1\)"):
        resolve_device("cuda:2")


def test_a_malformed_device_setting_is_refused_by_the_schema_and_the_resolver() -> None:
    with pytest.raises(ConfigError, match="not one of auto, cpu, cuda"):
        resolve_device("gpu0")
    with pytest.raises(ValidationError, match="device"):
        EngineConfig(device="tpu")
    assert EngineConfig(device="cuda:3").device == "cuda:3"


def test_the_share_is_at_most_095_in_the_schema() -> None:
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.96)
    assert EngineConfig().gpu_memory_utilization == 0.9


def test_blocks_come_from_the_share_left_after_weights_and_warm_up() -> None:
    memory = DeviceMemory(total_bytes=H200, free_bytes=120 * GIB, engine_bytes=18 * GIB)
    blocks = plan_device_blocks(BLOCK_BYTES_8B, 16, memory, 0.9, max_model_len=8192)
    assert blocks == (int(H200 * 0.9) - 18 * GIB) // BLOCK_BYTES_8B
    assert blocks * BLOCK_BYTES_8B <= memory.free_bytes


def test_a_share_too_small_for_one_sequence_is_refused_with_figures() -> None:
    memory = DeviceMemory(total_bytes=24 * GIB, free_bytes=8 * GIB, engine_bytes=16 * GIB)
    with pytest.raises(CapacityError) as refused:
        plan_device_blocks(BLOCK_BYTES_8B, 16, memory, 0.7, max_model_len=131072)
    text = str(refused.value)
    assert "16.80 GiB of the device's 24.00 GiB" in text
    assert "weights and warm-up take 16.00 GiB" in text
    assert f"needs {131072 // 16 * BLOCK_BYTES_8B // MIB} MiB" in text
    assert "raise engine.gpu_memory_utilization or lower engine.max_model_len" in text


def test_a_plan_larger_than_the_free_memory_names_the_other_holder() -> None:
    memory = DeviceMemory(total_bytes=H200, free_bytes=40 * GIB, engine_bytes=18 * GIB)
    with pytest.raises(CapacityError, match=r"only 40.00 GiB of the device is free: another process holds"):
        plan_device_blocks(BLOCK_BYTES_8B, 16, memory, 0.9, max_model_len=8192)


def test_workers_sharing_a_device_may_ask_for_095_together() -> None:
    check_shared_device({"prefill": 0.45, "decode": 0.5})
    with pytest.raises(ConfigError) as refused:
        check_shared_device({"prefill": 0.5, "decode": 0.5}, "cuda:0")
    assert "sharing cuda:0 ask for prefill 0.50 + decode 0.50 = 1.00" in str(refused.value)
    assert "at most 0.95" in str(refused.value)


def test_dtype_and_step_budget_follow_the_device() -> None:
    assert cuda_compute_dtype(True) == torch.bfloat16
    assert cuda_compute_dtype(False) == torch.float16
    assert default_batched_tokens(torch.device("cpu"), None) == 256
    assert default_batched_tokens(torch.device("cuda", 0), None) == 2048
    assert default_batched_tokens(torch.device("cuda", 0), 512) == 512
    assert default_batch_size_limit(torch.device("cpu"), None) == 32
    assert default_batch_size_limit(torch.device("cuda", 0), None) == 256  # gpu_check's batch 64 is 64
    assert default_batch_size_limit(torch.device("cuda", 0), 8) == 8


def test_weights_larger_than_the_share_or_the_free_memory_are_refused_before_loading() -> None:
    check_weights_fit(16 * GIB, H200, 130 * GIB, 0.9)
    with pytest.raises(CapacityError, match=r"the weights take 140.00 GiB, more than this engine's share"):
        check_weights_fit(140 * GIB, H200, 141 * GIB, 0.9)
    with pytest.raises(CapacityError, match=r"only 10.00 GiB of the device is free"):
        check_weights_fit(16 * GIB, H200, 10 * GIB, 0.9)


def test_decode_graphs_are_set_aside_before_the_kv_cache_is_planned() -> None:
    memory = DeviceMemory(total_bytes=H200, free_bytes=120 * GIB, engine_bytes=18 * GIB)
    without = plan_device_blocks(BLOCK_BYTES_8B, 16, memory, 0.9, max_model_len=8192)
    graphs = estimate_graph_bytes(LLAMA_8B, max_rows=256, max_blocks=512, dtype=torch.bfloat16)
    with_graphs = plan_device_blocks(BLOCK_BYTES_8B, 16, memory, 0.9, max_model_len=8192, graph_bytes=graphs)
    assert with_graphs == (int(H200 * 0.9) - 18 * GIB - graphs) // BLOCK_BYTES_8B < without
    # The estimate grows with the largest bucket and holds at least the logits buffer every bucket shares.
    assert graphs > 256 * LLAMA_8B.vocab_size * 4
    assert estimate_graph_bytes(LLAMA_8B, 64, 512, torch.bfloat16) < graphs
    tight = DeviceMemory(total_bytes=24 * GIB, free_bytes=8 * GIB, engine_bytes=20 * GIB)
    with pytest.raises(CapacityError, match=r"GiB is kept for decode graphs"):
        plan_device_blocks(BLOCK_BYTES_8B, 16, tight, 0.9, max_model_len=8192, graph_bytes=2 * GIB)
