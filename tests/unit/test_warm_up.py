"""The GPU KV plan's warm-up step holds the whole step's peak: the forward over a full token budget and
then the sampler over the step's most rows with every feature on (a GPU's top-p sorts every row in full),
so the KV cache is never sized into memory a full batch's sampling needs. Run here on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.engine.layers.kv_cache import KVCacheSpec
from services.engine.loading import factory
from services.engine.loading.loader import load_state_dict
from tests.tiny_model import TINY_LLAMA


def test_the_warm_up_samples_every_row_with_every_feature_on(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"])).eval()
    loaded = load_state_dict(hf.config.to_dict(), hf.state_dict(), dtype="float32", attention="torch")
    batches: list[Any] = []
    real = factory.sample_on_device

    def spy(logits: torch.Tensor, batch: Any, generator: torch.Generator) -> Any:
        batches.append(batch)
        return real(logits, batch, generator)

    monkeypatch.setattr(factory, "sample_on_device", spy)
    spec = KVCacheSpec.for_model(loaded.config, 16, loaded.model.kv_dtype)
    scratch = factory.warm_up(loaded.model, spec, 64, 24, torch.device("cpu"))
    assert scratch == 4 * spec.bytes_per_block
    (batch,) = batches
    assert batch.num_seqs == 24 and batch.num_sampled == 24
    assert batch.top_ks is not None and batch.top_ps is not None and batch.min_ps is not None
    assert batch.penalties is not None and batch.seeds is not None and batch.has_logprobs
