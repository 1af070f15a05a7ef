"""The quality bar of the GGUF block weights on the real SmolLM2 file (issue 26), over the fixture prompts
of tests/fixtures/smollm2_greedy_fp32.json:

- `model.weights gguf-int8` (blocks, decode kernels on int8 activations, and by default an fp16 KV cache):
  teacher-forced on the fixture's greedy continuations, its top-1 token agrees with the fp32 model's at
  >= 99% of positions;
- `model.weights gguf-hybrid`: the same bar on its small steps (the int8 kernels) and >= 98.5% on its
  large steps (the GEMM over the copy unpacked at load), each path forced through the threshold;
- both block paths load from the prepared directory's `model.gguf`, report a fingerprint of their own, and
  keep at most the GGUF's size + 10% of weights resident; so does gguf-int8 over an fp32 KV cache.

(`model.weights gguf` with fp32 activations passes the greedy fixture itself: test_engine_identity.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.manifest import GGUF_WEIGHTS_NAME, load_verified_manifest
from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.loading.loader import LoadedModel, load_model

pytestmark = pytest.mark.model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2_greedy_fp32.json"
BLOCK_SIZE = 16
CHUNK = 16  # tokens per step: small steps take the C kernels (the int8 path)
MIN_AGREEMENT = 0.99
MIN_LARGE_STEP_AGREEMENT = 0.985  # gguf-hybrid's GEMM steps


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return list(json.loads(FIXTURE.read_text())["cases"])


@pytest.fixture(scope="module")
def fp32(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, "float32", weights="safetensors")


@pytest.fixture(scope="module")
def fp32_top1(fp32: LoadedModel, cases: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The fp32 model's teacher-forced top-1 tokens for each case, computed once for every test here."""
    out = []
    for case in cases:
        prompt = case["prompt_token_ids"]
        out.append(teacher_forced_top1(fp32, prompt + case["output_token_ids"], len(prompt)))
    return out


@pytest.fixture(scope="module")
def int8(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, "float32", weights="gguf-int8")


def teacher_forced_top1(loaded: LoadedModel, tokens: list[int], num_prompt: int) -> torch.Tensor:
    """The model's top-1 next token at every position from the last prompt token on, fed `tokens` in
    CHUNK-token steps: [len(tokens) - num_prompt]."""
    model = loaded.model
    cfg = loaded.config
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    shape = (num_blocks * BLOCK_SIZE, 2, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.zeros(shape, dtype=model.kv_dtype) for _ in range(cfg.num_layers)]
    block_ids = list(range(num_blocks))
    picks = []
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start : start + CHUNK]
        meta = build_metadata([], [RowSpec(block_ids, start, len(chunk))], BLOCK_SIZE)
        logits = model.forward(torch.tensor(chunk), caches, meta, torch.arange(len(chunk)))  # [chunk, vocab]
        picks.append(logits.argmax(-1))
    return torch.cat(picks)[num_prompt - 1 : -1]


def test_int8_activations_agree_with_fp32_teacher_forced(
    fp32: LoadedModel, fp32_top1: list[torch.Tensor], int8: LoadedModel, cases: list[dict[str, Any]]
) -> None:
    assert (fp32.model.kv_dtype, int8.model.kv_dtype) == (torch.float32, torch.float16)  # the defaults
    num_same = num_positions = 0
    for case, want in zip(cases, fp32_top1, strict=True):
        prompt, output = case["prompt_token_ids"], case["output_token_ids"]
        tokens = prompt + output
        got = teacher_forced_top1(int8, tokens, len(prompt))
        num_same += int((got == want).sum())
        num_positions += len(want)
    agreement = num_same / num_positions
    assert agreement >= MIN_AGREEMENT, f"top-1 agreement {agreement:.4f} over {num_positions} positions"


@pytest.fixture(scope="module")
def hybrid(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, "auto", weights="gguf-hybrid", small_step_max_tokens=CHUNK)


@pytest.mark.parametrize(
    ("path", "threshold", "bar"), [("kernels", CHUNK, MIN_AGREEMENT), ("gemm", 1, MIN_LARGE_STEP_AGREEMENT)]
)
def test_hybrid_agrees_with_fp32_teacher_forced_on_either_path(
    fp32_top1: list[torch.Tensor],
    hybrid: LoadedModel,
    cases: list[dict[str, Any]],
    path: str,
    threshold: int,
    bar: float,
) -> None:
    """gguf-hybrid's small steps are gguf-int8's; its large steps multiply a copy unpacked at load (bf16
    where the CPU has bf16 units: activations rounded to bf16 on the way in) and so round otherwise."""
    model = hybrid.model
    model.small_step_max_tokens = threshold  # type: ignore[attr-defined]
    before = dict(model.num_steps_by_path)  # type: ignore[attr-defined]
    num_same = num_positions = 0
    for case, want in zip(cases, fp32_top1, strict=True):
        prompt, output = case["prompt_token_ids"], case["output_token_ids"]
        tokens = prompt + output
        got = teacher_forced_top1(hybrid, tokens, len(prompt))
        num_same += int((got == want).sum())
        num_positions += len(want)
    steps = {p: n - before[p] for p, n in model.num_steps_by_path.items()}  # type: ignore[attr-defined]
    # every step but a few took `path`: a prompt's 1-token tail chunk, chunks deep into a long context
    assert steps[path] >= 0.95 * sum(steps.values()), steps
    agreement = num_same / num_positions
    print(f"gguf-hybrid {path} steps: top-1 agreement {agreement:.4f} over {num_positions} positions")
    assert agreement >= bar, f"top-1 agreement {agreement:.4f} over {num_positions} positions ({path})"


def test_block_weights_have_their_own_fingerprint_and_stay_near_the_gguf_size(
    model_dir: Path, fp32: LoadedModel, int8: LoadedModel
) -> None:
    gguf_bytes = (model_dir / GGUF_WEIGHTS_NAME).stat().st_size
    assert int8.model.weight_bytes <= 1.10 * gguf_bytes, (int8.model.weight_bytes, gguf_bytes)
    manifest = load_verified_manifest(model_dir)
    assert GGUF_WEIGHTS_NAME in manifest.files  # the manifest pins the GGUF it serves
    assert fp32.manifest.model_fingerprint == manifest.model_fingerprint
    plain = load_model(model_dir, "float32", weights="gguf")
    int8_kv32 = load_model(model_dir, "float32", weights="gguf-int8", kv_cache_dtype="float32")
    assert (plain.model.kv_dtype, int8_kv32.model.kv_dtype) == (torch.float32, torch.float32)
    fingerprints = {
        manifest.model_fingerprint,
        plain.manifest.model_fingerprint,
        int8.manifest.model_fingerprint,
        int8_kv32.manifest.model_fingerprint,
    }
    assert len(fingerprints) == 4  # prefix caches and P/D pairs never mix weights or KV dtypes
    # each still names the directory it came from (workers report it; the router's pin is on it)
    assert plain.manifest.directory_fingerprint == int8.manifest.directory_fingerprint
    assert int8_kv32.manifest.directory_fingerprint == int8.manifest.directory_fingerprint
    assert int8.manifest.directory_fingerprint == manifest.model_fingerprint == manifest.directory_fingerprint
