"""CPU feature detection and the choices that rest on it: `model.dtype` -> precision, `model.weights`
auto -> the weights served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.errors import ConfigError
from services.common.manifest import GGUF_WEIGHTS_NAME
from services.engine.loading.loader import Precision, choose_weights, resolve_precision
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags, has_native_bf16_matmul

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "amx_bf16", "amx_tile"}


def test_reads_the_flags_line_of_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512_bf16\nbogomips\t: 1\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "fma", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_native_bf16_needs_avx512_bf16_or_amx() -> None:
    assert not has_native_bf16_matmul(AVX2)
    assert has_native_bf16_matmul(ZEN4)
    assert has_native_bf16_matmul(SAPPHIRE_RAPIDS)
    assert can_run_cpu_kernels(AVX2) and not can_run_cpu_kernels(frozenset({"sse4_2", "avx"}))


@pytest.mark.parametrize(
    ("dtype", "flags", "device", "want"),
    [
        ("float32", ZEN4, "cpu", Precision(torch.float32, torch.float32)),
        ("bfloat16", AVX2, "cpu", Precision(torch.bfloat16, torch.bfloat16)),
        ("auto", AVX2, "cpu", Precision(torch.bfloat16, torch.float32)),
        ("auto", ZEN4, "cpu", Precision(torch.bfloat16, torch.bfloat16)),
        ("auto", SAPPHIRE_RAPIDS, "cpu", Precision(torch.bfloat16, torch.bfloat16)),
        ("auto", AVX2, "cuda", Precision(torch.bfloat16, torch.bfloat16)),
    ],
)
def test_auto_takes_bf16_math_only_where_hardware_runs_it(
    dtype: str, flags: frozenset[str], device: str, want: Precision
) -> None:
    assert resolve_precision(dtype, device, flags) == want


def test_float32_on_request_is_pure_float32() -> None:
    precision = resolve_precision("float32", "cpu", AVX2)
    assert precision.weights == precision.compute == torch.float32
    assert precision.describe() == "float32"
    assert resolve_precision("auto", "cpu", AVX2).describe() == "bfloat16 weights, float32 compute"


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="float16"):
        resolve_precision("float16")


@pytest.fixture
def kept_gguf(tmp_path: Path) -> Path:
    """A model directory that kept its GGUF (choose_weights looks only for the file)."""
    (tmp_path / GGUF_WEIGHTS_NAME).write_bytes(b"GGUF")
    return tmp_path


def test_auto_weights_take_the_hybrid_wherever_the_blocks_run(kept_gguf: Path) -> None:
    """gguf-hybrid serves each step on the faster path for its size on every CPU with the kernels (the blocks
    for small steps, a GEMM over their unpacked copy for large ones): auto takes it there, and the
    safetensors wherever the blocks cannot run or a float dtype is asked for."""
    llama = "LlamaForCausalLM"

    def auto(model_dir: Path | None = kept_gguf, **given: object) -> str:
        settings: dict[str, object] = {"architecture": llama, "dtype": "auto", "device": "cpu", "flags": AVX2}
        return choose_weights("auto", model_dir, **{**settings, **given})  # type: ignore[arg-type]

    assert auto() == auto(flags=ZEN4) == auto(flags=SAPPHIRE_RAPIDS) == "gguf-hybrid"
    assert auto(flags=frozenset({"sse4_2", "avx"})) == "safetensors"  # no kernels
    assert auto(dtype="float32") == auto(dtype="bfloat16") == "safetensors"  # a float dtype asked for
    assert auto(device="cuda") == auto(attention="torch") == "safetensors"
    assert auto(architecture="Gemma3ForCausalLM") == "safetensors"
    assert auto(model_dir=kept_gguf / "missing") == auto(model_dir=None) == "safetensors"
    assert choose_weights("gguf", None) == "gguf"  # an explicit setting is never second-guessed
    with pytest.raises(ConfigError, match=r"model\.weights"):
        choose_weights("q4", kept_gguf)
