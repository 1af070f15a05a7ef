"""Every `model.dtype` on the real model: the chat answer stays sensible, and the kernel path agrees with
the torch path on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.codec.chat_template import chat_template_from_tokenizer, render_and_encode
from services.codec.tokenizer import Tokenizer
from services.common.sampling import SamplingParams
from services.engine.attention import RowSpec, build_metadata
from tests.engine_helpers import generate, make_engine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def capital_prompt(model_dir: Path) -> list[int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    template = chat_template_from_tokenizer(tokenizer)
    return render_and_encode(
        template, tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_capital_of_france_is_paris(model_dir: Path, capital_prompt: list[int], dtype: str) -> None:
    engine = make_engine(model_dir, dtype)
    out = generate(engine, {"q": capital_prompt}, SamplingParams(temperature=0.0, max_tokens=12))
    text = Tokenizer.from_dir(model_dir).decode(out["q"])
    assert "Paris" in text, f"{dtype}: {text!r}"


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_kernel_path_matches_torch_path_on_the_real_model(
    model_dir: Path, capital_prompt: list[int], dtype: str
) -> None:
    engine = make_engine(model_dir, dtype)
    model = engine.runner.model
    kernels = getattr(model, "kernels", None)
    if kernels is None:  # bf16 compute (AVX512-BF16/AMX): only decode attention runs in C
        _decode_attention_kernel_matches_sdpa(
            model, engine.runner.kv_caches, capital_prompt, engine.block_size
        )
        return
    caches = engine.runner.kv_caches
    num_tokens = len(capital_prompt)
    meta = build_metadata([], [RowSpec(list(range(8)), 0, num_tokens)], engine.block_size)
    token_ids = torch.tensor(capital_prompt)  # [num_tokens]
    fast = model._kernel_forward(kernels, token_ids, caches, meta)  # [num_tokens, hidden]
    slow = model._torch_forward(token_ids, caches, meta)  # [num_tokens, hidden]
    torch.testing.assert_close(fast, slow, atol=2e-3, rtol=2e-3)


def _decode_attention_kernel_matches_sdpa(
    model: Any, caches: list[torch.Tensor], prompt: list[int], block_size: int
) -> None:
    """Prefill the prompt, then one decode row: C decode attention (fp32 KV) against batched SDPA."""
    assert model.attention_kernels is not None and caches[0].dtype == torch.float32
    blocks = list(range(8))
    prefill = build_metadata([], [RowSpec(blocks, 0, len(prompt))], block_size)
    model._torch_forward(torch.tensor(prompt), caches, prefill)  # fills the cache
    decode = build_metadata([RowSpec(blocks, len(prompt), 1)], [], block_size)
    token = torch.tensor([prompt[-1]])  # [1]
    fast = model._torch_forward(token, caches, decode)  # [1, hidden]
    kernels, model.attention_kernels = model.attention_kernels, None
    try:
        slow = model._torch_forward(token, caches, decode)  # [1, hidden]
    finally:
        model.attention_kernels = kernels
    torch.testing.assert_close(fast.float(), slow.float(), atol=3e-2, rtol=3e-2)
