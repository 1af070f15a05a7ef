"""Every `model.dtype` on the real model: the chat answer stays sensible, and the kernel path agrees with
the torch path on the same weights."""

from __future__ import annotations

from pathlib import Path

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
    if kernels is None:
        pytest.skip("no kernel path for this dtype on this machine")
    caches = engine.runner.kv_caches
    num_tokens = len(capital_prompt)
    meta = build_metadata([], [RowSpec(list(range(8)), 0, num_tokens)], engine.block_size)
    token_ids = torch.tensor(capital_prompt)  # [num_tokens]
    fast = model._kernel_forward(kernels, token_ids, caches, meta)  # [num_tokens, hidden]
    slow = model._torch_forward(token_ids, caches, meta)  # [num_tokens, hidden]
    torch.testing.assert_close(fast, slow, atol=2e-3, rtol=2e-3)
