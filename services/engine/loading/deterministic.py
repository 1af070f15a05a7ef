"""`engine.deterministic`: the same tokens at the same positions give bitwise the same logits, whatever else
the step holds.

By default a step's size picks its path (models/llama.py): small steps run the C kernels, large ones torch's
GEMMs and SDPA, which sum in another order. So a token's numbers depend on its neighbours, on how its
prompt was chunked, on whether its prefix came from a cache (a hit leaves a shorter prefill) and on a
preemption's recompute. The C kernels give each token the same bits at every batch size and thread count
(each output row summed by one thread in one order; attention split at fixed 64-key chunks merged in
order; int8 activations quantized per token), so the mode runs every step on them.

What the mode allows, and what it refuses at start (ConfigError):

- a CPU with the kernels (AVX2, FMA, F16C) and a Llama-family model they fit (no q/k norms, no windows);
- weights `gguf` (blocks, fp32 activations), `gguf-int8` (blocks, int8 activations) and `safetensors`
  with fp32 compute (bf16 weights read by the kernels, or float32). `auto` picks gguf-int8 where the
  blocks run: gguf-hybrid's large steps are a GEMM over an unpacked copy, so it is refused by name;
  model.dtype bfloat16 (bf16 compute runs on torch) too;
- not CUDA: cuBLAS picks its kernels by shape and the Triton attention splits by the graph bucket, so a
  GPU path needs its own batch-invariant kernels first (docs/gpu.md, "Deterministic mode").

Across replicas the bits hold for one kernel build only (the instruction sets it was compiled for, the
compiler, the source) and, to be safe, one thread count: both join the model fingerprint, which the
router pins, the prefix cache hashes and the KV tiers key by. So KV computed in the default mode (or by
another build) is never read by a deterministic replica.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from services.common.errors import ConfigError
from services.common.manifest import Manifest
from services.engine.models.registry import CausalLM

MODES = ("default", "deterministic")  # the worker's numerics mode, as its info and status show it
SETTING = "engine.deterministic"


def check_device(device: torch.device) -> None:
    if device.type == "cuda":
        raise ConfigError(
            f"{SETTING} is refused on CUDA: cuBLAS and the Triton attention are not batch-invariant "
            "(docs/gpu.md, 'Deterministic mode'); run it on a CPU"
        )


def weights_for(setting: str, chosen: str) -> str:
    """model.weights under the mode: `chosen` is what `setting` resolves to (loader.choose_weights)."""
    if chosen != "gguf-hybrid":
        return chosen
    if setting == "auto":
        return "gguf-int8"  # the blocks on the kernels at every step, no unpacked copy
    raise ConfigError(
        f"{SETTING} refuses model.weights gguf-hybrid: its large steps are a GEMM over an unpacked copy, "
        "not the C kernels; set model.weights gguf-int8, gguf or auto"
    )


def check_dtype(dtype: str) -> None:
    if dtype == "bfloat16":
        raise ConfigError(
            f"{SETTING} needs fp32 compute (the C kernels): model.dtype auto or float32, not bfloat16"
        )


def kernel_build(model: object) -> str:
    """The C kernels' build id where every step of `model` can run on them, else a ConfigError."""
    kernels = getattr(model, "kernels", None)
    if kernels is None:
        raise ConfigError(
            f"{SETTING} needs every step on the C kernels, which do not run this model here: they need an "
            "x86 CPU with AVX2, FMA and F16C, fp32 compute, engine.attention auto and a Llama-family model "
            "without q/k norms or sliding windows"
        )
    return str(kernels.build_id)


def numerics_fingerprint(model_fingerprint: str, build_id: str, num_threads: int) -> str:
    """The fingerprint of a model served in the mode: its numbers hold for this kernel build and thread
    count, so replicas that differ in either never pair, share a prefix cache or read each other's KV."""
    text = f"{model_fingerprint}\x00deterministic\x00kernels={build_id}\x00threads={num_threads}"
    return hashlib.sha256(text.encode()).hexdigest()


def enable(model: CausalLM, manifest: Manifest) -> Manifest:
    """Turn the mode on for a built model (every step on the kernels); the manifest it is now served
    under (its fingerprint and provenance)."""
    build_id = kernel_build(model)
    model.deterministic = True  # type: ignore[attr-defined]
    threads = torch.get_num_threads()
    fingerprint = numerics_fingerprint(manifest.model_fingerprint, build_id, threads)
    source = {
        **manifest.source,
        "numerics": "deterministic",
        "kernels": build_id,
        "threads": str(threads),
        "directory_fingerprint": manifest.directory_fingerprint,
    }
    return dataclasses.replace(manifest, model_fingerprint=fingerprint, source=source)
