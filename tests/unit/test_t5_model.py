"""The T5 family's math (services/engine/models/t5.py) against transformers (fp32), on tiny random models
with raised initializer_factor so the logits are not flat: plain (ReLU) and gated GELU, tied and untied
heads. Teacher-forced logits agree within 1e-4 at every step, whole and one token at a time; greedy tokens
equal transformers' generate up to the first near-tie. The byte tokenizer the tests build is ByT5's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.common.errors import ConfigError, CorruptModelError, ModelLoadError
from services.engine.models.t5 import T5Config, T5Model, relative_position_bucket
from tests.tiny_t5 import byte_tokenizer, make_tiny_t5

# name: (gated, tied, saved by transformers 5: every table stored, tie_word_embeddings always true)
VARIANTS = {
    "relu-tied": (False, True, False),
    "gated-untied": (True, False, False),
    "gated-tied": (True, True, False),
    "gated-untied-transformers5": (True, False, True),
}
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[T5Model, Any]:
    gated, tied, transformers5 = VARIANTS[request.param]
    path, reference = make_tiny_t5(
        tmp_path_factory.mktemp(request.param), gated=gated, tied=tied, saved_by_transformers5=transformers5
    )
    config = T5Config.from_dict(json.loads((path / "config.json").read_text()))
    assert (config.is_gated, config.scale_decoder_output) == (gated, tied)
    model = T5Model(config, load_file(str(path / "model.safetensors")), torch.float32)
    assert (model.lm_head is model.embed) == tied
    return model, reference


def source(length: int, seed: int) -> torch.Tensor:
    """`length` random bytes as ByT5 IDs, ending with EOS as T5's tokenizer appends it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(3, 259, (length - 1,), generator=generator), torch.tensor([1])])


@pytest.mark.parametrize("length", [1, 7, 60])
def test_teacher_forced_logits_match_transformers_at_every_step(
    tiny: tuple[T5Model, Any], length: int
) -> None:
    model, reference = tiny
    src = source(length, seed=length)
    target = torch.cat([torch.tensor([0]), source(12, seed=100 + length)[:-1]])  # start token, then 11
    with torch.no_grad():
        want = reference(input_ids=src[None], decoder_input_ids=target[None]).logits[0]  # [12, vocab]
    encoded = model.encode(src)
    whole = model.decode(target, model.start(encoded))
    cache = model.start(encoded)
    stepwise = torch.cat([model.decode(target[i : i + 1], cache) for i in range(target.shape[0])])
    assert want.std() > 1.0  # not flat: the comparison means something
    torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(stepwise, want, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers_generate_up_to_a_near_tie(tiny: tuple[T5Model, Any]) -> None:
    model, reference = tiny
    compared = total = 0
    for seed, length in ((1, 5), (2, 33), (3, 90)):
        src = source(length, seed)
        with torch.no_grad():
            generated = reference.generate(
                src[None], max_new_tokens=24, do_sample=False, num_beams=1, output_scores=True,
                return_dict_in_generate=True, min_new_tokens=24,
            )  # fmt: skip
        want = generated.sequences[0, 1:].tolist()
        cache, token = model.start(model.encode(src)), torch.tensor([0])
        for step, expected in enumerate(want):
            logits = model.decode(token, cache)[-1].clone()
            logits[1] = float("-inf")  # min_new_tokens: EOS is not allowed before the end, as above
            total += 1
            top2 = generated.scores[step][0].topk(2).values
            if int(logits.argmax()) != expected:
                assert float(top2[0] - top2[1]) < NEAR_TIE, f"seed {seed}: diverged at step {step}"
                break
            compared += 1
            token = torch.tensor([expected])
    assert compared >= 0.8 * total


def test_relative_position_buckets_match_transformers() -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 300)[None, :] - torch.zeros(1, dtype=torch.long)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 20)):
            ours = relative_position_bucket(
                relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
            )
            theirs = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
            assert torch.equal(ours, theirs)


def test_fp16_an_unknown_feed_forward_and_stray_weights_are_refused(tmp_path: Path) -> None:
    path, _ = make_tiny_t5(tmp_path / "t5")
    raw = json.loads((path / "config.json").read_text())
    config, weights = T5Config.from_dict(raw), load_file(str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="fp16"):
        T5Model(config, weights, torch.float16)
    with pytest.raises(ModelLoadError, match="feed_forward_proj 'gated-silu'"):
        T5Config.from_dict({**raw, "feed_forward_proj": "gated-silu"})
    with pytest.raises(ModelLoadError, match=r"does not use these weights: encoder\.extra"):
        T5Model(config, {**weights, "encoder.extra": torch.zeros(1)}, torch.float32)


def test_checkpoint_forms_real_ones_take(tmp_path: Path) -> None:
    """A table only under the stacks' names (some checkpoints have no `shared`), the cross-attention bias
    table old t5-small and t5-base checkpoints carry (no T5 uses it), and a config without
    tie_word_embeddings (T5 v1.0: tied, scaled) load; stacks whose tables differ are refused."""
    path, reference = make_tiny_t5(tmp_path / "t5", saved_by_transformers5=True)
    raw = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    shared = weights.pop("shared.weight")
    weights["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.zeros(8, 3)
    del raw["tie_word_embeddings"], raw["scale_decoder_outputs"]
    model = T5Model(T5Config.from_dict(raw), weights, torch.float32)
    src, target = source(9, seed=4), torch.tensor([0, 50, 60, 70])
    with torch.no_grad():
        want = reference(input_ids=src[None], decoder_input_ids=target[None]).logits[0]
    torch.testing.assert_close(model.decode(target, model.start(model.encode(src))), want, atol=1e-4, rtol=0)
    weights["decoder.embed_tokens.weight"] = shared + 1
    with pytest.raises(CorruptModelError, match="embedding tables differ"):
        T5Model(T5Config.from_dict(raw), weights, torch.float32)


def test_the_byte_tokenizer_is_byt5s() -> None:
    from transformers import ByT5Tokenizer

    ours, theirs = byte_tokenizer(), ByT5Tokenizer()
    for text in ("hello", "héllo wörld ✓", "a\nb\tc", "", "日本語 and bytes"):
        assert ours.encode(text).ids == theirs(text).input_ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text


def test_a_batched_encoder_pass_gives_each_source_its_own_output(tiny: tuple[T5Model, Any]) -> None:
    model, _ = tiny
    srcs = [source(n, seed=n) for n in (1, 13, 64, 5)]
    batched = model.encode_batch(srcs)
    for src, got in zip(srcs, batched, strict=True):
        assert got.shape == (src.shape[0], model.config.d_model)
        torch.testing.assert_close(got, model.encode_batch([src])[0], atol=1e-5, rtol=0)  # padding is masked
