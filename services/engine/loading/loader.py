"""Loading a model: from a prepared directory (manifest check, config, safetensors weights) or from a state
dict already in memory (a GPU check builds its model on the device); dtype resolution for both."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from services.common.errors import ConfigError, CorruptModelError, ModelLoadError, ModelNotFoundError
from services.common.manifest import GGUF_WEIGHTS_NAME, UNKNOWN_FINGERPRINT, Manifest, load_verified_manifest
from services.engine.kv_export import dtype_name
from services.engine.layers.kv_cache import fits_host_memory
from services.engine.loading import deterministic as numerics
from services.engine.loading.gguf_weights import BLOCK_ARCHITECTURES, load_gguf_weights
from services.engine.model_config import ModelConfig
from services.engine.models.registry import CausalLM, build_model
from services.engine.ops import step_threshold
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags, has_native_bf16_matmul
from services.engine.ops.quant import QuantizedWeight
from services.engine.ops.step_threshold import StepThreshold

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_CHOICES = ("safetensors", "gguf", "gguf-int8", "gguf-hybrid")  # model.weights besides auto
BLOCK_CHOICES = ("gguf", "gguf-int8", "gguf-hybrid")  # the GGUF blocks kept as stored, on the C kernels


@dataclass(frozen=True)
class Precision:
    """How weights are stored and in which dtype activations, the KV cache and sums are computed.
    `blocks`: the weights are GGUF blocks kept as stored (`weights` then names the dtype of the rest)."""

    weights: torch.dtype
    compute: torch.dtype
    blocks: bool = False
    unpacked: torch.dtype | None = None  # gguf-hybrid: the blocks' load-time copy for large steps

    def describe(self) -> str:
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if self.blocks and self.unpacked is not None:
            return (
                f"GGUF blocks (Q4_1, Q8_0) for small steps and a {names[self.unpacked]} copy unpacked at "
                f"load for large ones, {names[self.compute]} compute"
            )
        if self.blocks:
            return f"GGUF blocks (Q4_1, Q8_0) as stored, {names[self.compute]} compute"
        if self.weights == self.compute:
            return names[self.weights]
        return f"{names[self.weights]} weights, {names[self.compute]} compute"


def choose_weights(
    weights: str,
    model_dir: Path | None = None,
    *,
    architecture: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    attention: str = "auto",
    flags: frozenset[str] | None = None,
) -> str:
    """`model.weights` resolved. "auto" takes gguf-hybrid wherever the GGUF blocks can run: a CPU with the
    C kernels' instruction sets, with `model.dtype` and `engine.attention` auto, serving a Llama-family
    directory that kept its GGUF (`kvrelay models prepare` keeps it only when every tensor can stay in
    blocks); load_model falls back to gguf-int8 where host memory cannot hold the unpacked copy too. One
    format for the whole process loses somewhere (docs/performance.md, "GGUF blocks"): on a Zen 4 EPYC
    (AVX512-BF16) the bf16 safetensors ran 905 / 41.7 / 507 tok/s (prefill / batch 1 / batch 32) and
    gguf-int8 773 / 164.5 / 393, so the blocks win the small steps 4x and oneDNN's bf16 GEMM the large
    ones; on AVX2 CPUs the blocks' int8 kernels win the small steps and an fp32 GEMM the large ones.
    gguf-hybrid runs each step on the faster of the two (ops/step_threshold.py)."""
    if weights in WEIGHT_CHOICES:
        return weights
    if weights != "auto":
        raise ConfigError(f"model.weights {weights!r} is not one of auto, {', '.join(WEIGHT_CHOICES)}")
    cpu = cpu_flags() if flags is None else flags
    blocks_run = (
        model_dir is not None
        and (Path(model_dir) / GGUF_WEIGHTS_NAME).is_file()
        and architecture in BLOCK_ARCHITECTURES
        and dtype == "auto"
        and device == "cpu"
        and attention == "auto"
        and can_run_cpu_kernels(cpu)
    )
    return "gguf-hybrid" if blocks_run else "safetensors"


def weights_fingerprint(model_fingerprint: str, weights: str) -> str:
    """The model fingerprint of the weights actually served: the GGUF blocks (and int8 activations over
    them) compute other numbers than the dequantized safetensors, so prefix-cache hashes, P/D pairing and
    caches must never mix them."""
    if weights == "safetensors":
        return model_fingerprint
    return hashlib.sha256(f"{model_fingerprint}\x00weights={weights}".encode()).hexdigest()


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # engine.kv_cache_dtype


def resolve_kv_dtype(setting: str, model: CausalLM, int8_activations: bool) -> torch.dtype:
    """`engine.kv_cache_dtype` for a built model. auto: fp16 where gguf-int8 runs on the C kernels (as
    llama.cpp keeps its cache: half the bytes a decode step's attention reads), else the family's own
    choice (fp32 on the C kernels, the compute dtype elsewhere). An explicit dtype other than the family's
    needs torch attention (the C kernels included), which casts on store and attends in the wider dtype;
    the Triton kernels keep their own, so that is refused."""
    natural = model.kv_dtype
    if setting == "auto":
        on_kernels = getattr(model, "attention_kernels", None) is not None
        return torch.float16 if int8_activations and on_kernels else natural
    if setting not in KV_CACHE_DTYPES:
        known = ", ".join(KV_CACHE_DTYPES)
        raise ConfigError(f"engine.kv_cache_dtype {setting!r} is not one of auto, {known}")
    wanted = KV_CACHE_DTYPES[setting]
    if wanted != natural and model.paged.name != "torch":
        raise ConfigError(
            f"engine.kv_cache_dtype {setting} needs torch attention or the CPU kernels: the "
            f"{model.paged.name} kernels keep the KV cache in {str(natural).removeprefix('torch.')}"
            " (set engine.kv_cache_dtype auto, or engine.attention torch)"
        )
    return wanted


def kv_fingerprint(model_fingerprint: str, kv_dtype: torch.dtype) -> str:
    """The fingerprint of a model whose KV cache holds other numbers than its family would keep (fp16 KV
    rounds keys and values): prefix-cache hashes, P/D pairing and caches must not mix the two."""
    name = dtype_name(kv_dtype)
    return hashlib.sha256(f"{model_fingerprint}\x00kv={name}".encode()).hexdigest()


def resolve_precision(dtype: str, device: str = "cpu", flags: frozenset[str] | None = None) -> Precision:
    """`model.dtype` to a precision. "auto" takes bf16 throughout where bf16 math runs in hardware (CUDA,
    AVX512-BF16 or AMX CPUs), and bf16 weights with fp32 compute elsewhere: on an AVX2-only CPU bf16
    matmuls are emulated and slow, while fp32 math over bf16 weights reads as few bytes per decode step.
    """
    if dtype in DTYPES:
        return Precision(DTYPES[dtype], DTYPES[dtype])
    if dtype != "auto":
        raise ConfigError(f"model.dtype {dtype!r} is not one of auto, float32, bfloat16")
    if device == "cuda":  # bf16 throughout; fp16 on a GPU without bf16 (before Ampere)
        no_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported()
        half = torch.float16 if no_bf16 else torch.bfloat16
        return Precision(half, half)
    native = has_native_bf16_matmul(cpu_flags() if flags is None else flags)
    return Precision(torch.bfloat16, torch.bfloat16 if native else torch.float32)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    manifest: Manifest
    weight_bytes: int
    precision: Precision | None = None
    weights: str = "safetensors"  # the model.weights served (auto resolved)
    step_threshold: StepThreshold | None = None  # where small steps end, when the C kernels run them
    numerics: str = "default"  # default, or deterministic (engine.deterministic: deterministic.py)


def load_model(
    model_dir: str | Path,
    dtype: str,
    device: torch.device | None = None,
    *,
    attention: str = "auto",
    block_size: int = 16,
    weights: str = "safetensors",  # model.weights
    kv_cache_dtype: str = "auto",  # engine.kv_cache_dtype
    small_step_max_tokens: int | None = None,  # engine.small_step_max_tokens
    kv_cache_bytes: int = 0,  # the host KV cache to come (engine.kv_cache_memory_mb), for auto's memory check
    deterministic: bool = False,  # engine.deterministic: every step on the C kernels (deterministic.py)
) -> LoadedModel:
    """Verify the directory against its manifest, then build the model on `device` (the CPU by default),
    its layers on the paged attention `engine.attention` names (attention_backend.py) for KV blocks of
    `block_size` in `kv_cache_dtype` (resolve_kv_dtype), over the weights `model.weights` names
    (choose_weights). Nothing loads from a hub."""
    device = device or torch.device("cpu")
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if deterministic:
        numerics.check_device(device)
        numerics.check_dtype(dtype)
    manifest = load_verified_manifest(path, scope="model")
    config = ModelConfig.from_dir(path)
    chosen = choose_weights(
        weights, path, architecture=config.architecture, dtype=dtype, device=device.type, attention=attention
    )
    if deterministic:
        chosen = numerics.weights_for(weights, chosen)
    if chosen in BLOCK_CHOICES:
        options = _BlockOptions(
            chosen, weights == "auto" and not deterministic, small_step_max_tokens, kv_cache_bytes
        )
        blocks = _load_gguf_blocks(
            path, manifest, config, dtype, device, attention, block_size, kv_cache_dtype, options
        )
        return _deterministic(blocks) if deterministic else blocks
    precision = resolve_precision(dtype, device.type)
    if deterministic:  # bf16 weights stay bf16 (the kernels read them as stored); the sums are fp32
        precision = Precision(precision.weights, torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            loaded = load_file(str(file), device=str(device))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
        tensors.update({name: t.to(precision.weights) for name, t in loaded.items()})
        del loaded
    built = _build(
        config, tensors, manifest, precision, dtype, attention, block_size, kv_cache_dtype,
        small_step_max_tokens=small_step_max_tokens,
    )  # fmt: skip
    return _deterministic(built) if deterministic else built


def _deterministic(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with engine.deterministic on: no step threshold (every step runs the kernels), served under
    the fingerprint of its numbers (deterministic.numerics_fingerprint)."""
    manifest = numerics.enable(loaded.model, loaded.manifest)
    log.info(
        "engine.deterministic: every step on the C kernels",
        extra={"model_fingerprint": manifest.model_fingerprint},
    )
    return dataclasses.replace(loaded, manifest=manifest, step_threshold=None, numerics="deterministic")


@dataclass(frozen=True)
class _BlockOptions:
    weights: str  # gguf, gguf-int8 or gguf-hybrid
    is_auto: bool  # chosen by model.weights auto: gguf-hybrid may fall back to gguf-int8 for memory
    small_step_max_tokens: int | None  # engine.small_step_max_tokens
    kv_cache_bytes: int


def _load_gguf_blocks(
    path: Path,
    manifest: Manifest,
    config: ModelConfig,
    dtype: str,
    device: torch.device,
    attention: str,
    block_size: int,
    kv_cache_dtype: str,
    options: _BlockOptions,
) -> LoadedModel:
    """The directory's GGUF (pinned by its manifest like every file) with its blocks kept as stored;
    gguf-int8 and gguf-hybrid run the decode kernels on int8 activations, and gguf-hybrid also unpacks
    the blocks once for the large steps (bf16 where the CPU multiplies bf16 in hardware, else fp32)."""
    weights = options.weights
    gguf = path / GGUF_WEIGHTS_NAME
    if not gguf.is_file():
        raise ModelLoadError(
            f"model.weights {weights}: {path} keeps no {GGUF_WEIGHTS_NAME}; prepare it again from its GGUF "
            "(kvrelay models prepare --force)"
        )
    if device.type != "cpu" or dtype == "bfloat16":
        raise ConfigError(
            f"model.weights {weights} runs on the CPU kernels in float32: engine.device cpu, model.dtype "
            "auto or float32"
        )
    flags = cpu_flags()
    if not can_run_cpu_kernels(flags):
        raise ConfigError(
            f"model.weights {weights} needs the CPU kernels, which need an x86 CPU with AVX2, FMA and F16C; "
            "this CPU lacks them: set model.weights safetensors (or auto)"
        )
    blocks = load_gguf_weights(gguf, config)
    unpacked = (
        (torch.bfloat16 if has_native_bf16_matmul(flags) else torch.float32)
        if weights == "gguf-hybrid"
        else None
    )
    if unpacked is not None and options.is_auto:
        weights, unpacked = _hybrid_or_blocks(blocks, unpacked, options.kv_cache_bytes)
    threshold = (
        step_threshold.resolve(options.small_step_max_tokens, flags, torch.get_num_threads())
        if unpacked is not None
        else None
    )
    fingerprint = weights_fingerprint(manifest.model_fingerprint, weights)
    provenance = {**manifest.source, "weights": weights, "directory_fingerprint": manifest.model_fingerprint}
    served = dataclasses.replace(manifest, model_fingerprint=fingerprint, source=provenance)
    precision = Precision(torch.float32, torch.float32, blocks=True, unpacked=unpacked)
    step_max = threshold.max_tokens if threshold is not None else options.small_step_max_tokens
    loaded = _build(
        config,
        blocks,  # type: ignore[arg-type]
        served,
        precision,
        "float32",
        attention,
        block_size,
        kv_cache_dtype,
        int8_activations=weights != "gguf",
        small_step_max_tokens=step_max,
        threshold=threshold,
    )
    return dataclasses.replace(loaded, weights=weights)


def _hybrid_or_blocks(
    blocks: Mapping[str, Any], unpacked: torch.dtype, kv_cache_bytes: int
) -> tuple[str, torch.dtype | None]:
    """gguf-hybrid where host memory holds the blocks, their unpacked copy and the KV cache; else gguf-int8
    (the blocks alone: the large steps unpack per step), said in the log."""
    elem = torch.empty((), dtype=unpacked).element_size()
    matrices = [w for w in blocks.values() if isinstance(w, QuantizedWeight)]
    copy_bytes = sum(w.shape[0] * w.shape[1] for w in matrices) * elem
    stored_bytes = sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * 4 for w in blocks.values())
    if fits_host_memory(stored_bytes + copy_bytes + kv_cache_bytes):
        return "gguf-hybrid", unpacked
    log.warning(
        "model.weights auto: gguf-int8, not gguf-hybrid: host memory cannot hold the unpacked copy too",
        extra={
            "unpacked_copy_bytes": copy_bytes,
            "stored_bytes": stored_bytes,
            "kv_cache_bytes": kv_cache_bytes,
        },
    )
    return "gguf-int8", None


def stored_weight_bytes(model_dir: str | Path, dtype: str, device: str = "cuda") -> int:
    """The bytes the weights of a prepared directory will take once loaded in `dtype` on `device`, read
    from the safetensors headers alone (nothing is loaded), so a device too small refuses before it runs."""
    elem = torch.empty((), dtype=resolve_precision(dtype, device).weights).element_size()
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    total += math.prod(f.get_slice(name).get_shape()) * elem
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"cannot read weights {file.name}: {exc}") from exc
    return total


def load_state_dict(
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    dtype: str = "auto",
    fingerprint: str | None = None,
    *,
    attention: str = "auto",
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """A model from a transformers-style config dict and state dict in memory, without a disk round trip.

    The tensors keep their device. A state dict has no files for a manifest to pin, so the model
    fingerprint (prefix-cache hashes, P/D pairing) is `fingerprint` when given, else a digest of the
    config and of every tensor's name, shape and dtype: two different random models of one shape share it,
    so pass a fingerprint wherever replicas built this way must not pair.
    """
    model_config = ModelConfig.from_dict(dict(config))
    device = next(iter(state_dict.values())).device.type if state_dict else "cpu"
    precision = resolve_precision(dtype, device)
    weights = {name: t.to(precision.weights) for name, t in state_dict.items()}
    manifest = Manifest(
        files={},
        tokenizer_fingerprint=UNKNOWN_FINGERPRINT,
        model_fingerprint=fingerprint or _state_dict_digest(config, state_dict),
        source={"kind": "state_dict"},
    )
    return _build(model_config, weights, manifest, precision, dtype, attention, block_size, kv_cache_dtype)


def _state_dict_digest(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(dict(config), sort_keys=True, default=str).encode())
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    return digest.hexdigest()


def _build(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    manifest: Manifest,
    precision: Precision,
    dtype: str,
    attention: str = "auto",
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    *,
    int8_activations: bool = False,
    small_step_max_tokens: int | None = None,
    threshold: StepThreshold | None = None,
) -> LoadedModel:
    model = build_model(
        config,
        weights,
        precision.compute,
        attention=attention,
        block_size=block_size,
        int8_activations=int8_activations,
        unpacked_dtype=precision.unpacked,
        small_step_max_tokens=small_step_max_tokens,
    )
    if threshold is None and getattr(model, "kernels", None) is not None:
        threshold = StepThreshold(model.small_step_max_tokens, _threshold_source(small_step_max_tokens))  # type: ignore[attr-defined]
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, model, int8_activations)
    if kv_dtype != model.kv_dtype:
        model.kv_dtype = kv_dtype
        provenance = {
            **manifest.source,
            "kv_cache_dtype": dtype_name(kv_dtype),
            "directory_fingerprint": manifest.directory_fingerprint,
        }
        fingerprint = kv_fingerprint(manifest.model_fingerprint, kv_dtype)
        manifest = dataclasses.replace(manifest, model_fingerprint=fingerprint, source=provenance)
    weight_bytes = getattr(model, "weight_bytes", None)
    if weight_bytes is None:  # a family that does not count its own (float tensors only)
        elem = torch.empty((), dtype=precision.weights).element_size()
        weight_bytes = sum(t.numel() for t in weights.values()) * elem
    log.info(
        "model loaded",
        extra={
            "model_fingerprint": manifest.model_fingerprint,
            "dtype": dtype,
            "precision": precision.describe(),
            "kv_cache_dtype": dtype_name(model.kv_dtype),
            "weight_bytes": weight_bytes,
            "small_step_max_tokens": None if threshold is None else threshold.max_tokens,
            "small_step_source": None if threshold is None else threshold.source,
        },
    )
    return LoadedModel(model, config, manifest, weight_bytes, precision, step_threshold=threshold)


def _threshold_source(setting: int | None) -> str:
    return step_threshold.SETTING if setting is not None else "the model family's default"
